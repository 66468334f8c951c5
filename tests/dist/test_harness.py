"""Tests of the multi-process harness `tests/_dist.py` and gloo smoke tests of the primitives SP needs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from tests._dist import run_distributed


def _all_reduce_worker(rank: int, world_size: int, scale: float = 1.0) -> dict:
    tensor = torch.full((3,), float(rank + 1)) * scale
    dist.all_reduce(tensor)
    return {
        "rank": rank,
        "sum": tensor,
        "module": __name__,
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
    }


def test_all_reduce_returns_results_ordered_by_rank():
    results = run_distributed(_all_reduce_worker, 2, 2.0, timeout=60)

    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        # (1 + 2) * 2.0 on both ranks.
        torch.testing.assert_close(r["sum"], torch.full((3,), 6.0))
        assert r["backend"] == "gloo"
        assert r["threads"] == 1
        # fn was pickled by reference and re-imported in the child under its qualified name.
        assert r["module"] == "tests.dist.test_harness"


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the worker")
    return rank


def test_worker_exception_is_reraised_with_rank_and_traceback():
    with pytest.raises(RuntimeError) as excinfo:
        run_distributed(_raise_on_rank_1, 2, timeout=60)

    message = str(excinfo.value)
    assert "rank 1" in message
    assert "ValueError" in message
    assert "boom from the worker" in message
    assert "Traceback" in message
    assert "_raise_on_rank_1" in message


def _rank_1_blocks_in_collective(rank: int, world_size: int, pid_dir: str) -> int:
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 1:
        # Rank 0 never joins this all_reduce: a classic rank desync.
        dist.all_reduce(torch.ones(1))
    return rank


def test_hang_is_killed_and_reported_as_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError) as excinfo:
        run_distributed(_rank_1_blocks_in_collective, 2, str(tmp_path), timeout=10)

    assert time.monotonic() - start >= 10  # it waited for the deadline (a clock cannot run short)
    for rank in (0, 1):  # and every worker is gone when it raises, the blocked one too
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"rank{rank}").read_text()), 0)
    message = str(excinfo.value)
    assert "ranks still running: [1]" in message
    assert "finished: [0]" in message


def _lambda_is_rejected_worker():
    return lambda rank, world_size: rank


def test_unpicklable_fn_is_rejected_before_spawning():
    with pytest.raises(ValueError, match="module level"):
        run_distributed(_lambda_is_rejected_worker(), 2)


def _gloo_primitives_worker(rank: int, world_size: int) -> dict:
    # all_to_all_single: rank r sends chunk j (values 10*r + j) to rank j.
    send = torch.tensor([10.0 * rank + j for j in range(world_size)])
    recv = torch.empty(world_size)
    dist.all_to_all_single(recv, send)

    # Differentiable all_gather: grad of sum(weight_i * gathered_i) w.r.t. the local input is the sum
    # over ranks of weight_rank (each rank's backward reduce-scatters its gradient to the owner).
    local = torch.full((2,), float(rank + 1), requires_grad=True)
    gathered = dist_nn.all_gather(local)
    weights = [float(i + 1) for i in range(world_size)]
    loss = sum(w * g.sum() for w, g in zip(weights, gathered, strict=True)) * (rank + 1)
    loss.backward()
    return {
        "recv": recv,
        "gathered": [g.detach() for g in gathered],
        "grad": local.grad,
    }


def test_gloo_all_to_all_single_and_differentiable_all_gather():
    world_size = 2
    results = run_distributed(_gloo_primitives_worker, world_size, timeout=60)

    for rank, r in enumerate(results):
        # Rank r receives chunk r from every rank j: 10*j + r.
        torch.testing.assert_close(r["recv"], torch.tensor([10.0 * j + rank for j in range(world_size)]))
        for j, g in enumerate(r["gathered"]):
            torch.testing.assert_close(g, torch.full((2,), float(j + 1)))
        # d loss_k / d local_r = (k + 1) * (r + 1) for each element; summed over k in {0, 1}: 3 * (r + 1).
        torch.testing.assert_close(r["grad"], torch.full((2,), 3.0 * (rank + 1)))

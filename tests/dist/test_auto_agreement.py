"""`sp_backend="auto"` is agreed across the SP ranks: a rank that sees another job (here rank 1 is told it is
alone on its node, LOCAL_WORLD_SIZE=1, so auto picks the ring there and Ulysses on rank 0) makes
`enable_sequence_parallel` raise on every rank, naming both ranks and their choices, before any attention
collective (counted: the ranks never ran different backends), instead of the two ranks running different backends
into a hang or a wrong loss.
"""

from __future__ import annotations

import os

import torch

import hf_longctx
from hf_longctx.instrument import record_collectives
from tests import _faults
from tests._models import tiny_model

LAUNCH_TIMEOUT_S = 120
ATTENTION_OPS = {"all_to_all", "ring_p2p", "ring_all_gather", "ring_reduce_scatter"}


def auto_worker(rank: int, world_size: int, local_world_sizes: list[int]) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_sizes[rank])
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    with record_collectives() as stats:
        try:
            handle = hf_longctx.enable_sequence_parallel(tiny_model("llama"), groups, backend="auto")
        except ValueError as exc:
            return {"message": str(exc), "collectives": _calls(stats)}
        ids = torch.arange(16).unsqueeze(0) % 100 + 1
        shard = hf_longctx.shard_batch({"input_ids": ids, "labels": ids}, groups)
        shard.pop("shift_labels")
        handle.model(**shard)  # agreed: the forward runs
    return {"message": None, "backend": handle.backend.name, "collectives": _calls(stats)}


def _calls(stats) -> dict[str, int]:
    return {op: stat.calls for op, stat in stats.ops.items()}


def _launch(local_world_sizes: list[int]) -> list[dict]:
    outcomes = _faults.launch(auto_worker, 2, local_world_sizes, timeout=LAUNCH_TIMEOUT_S)
    assert all(o.ok for o in outcomes), [(o.rank, o.hung, o.error) for o in outcomes]
    return [o.result for o in outcomes]


def test_ranks_that_resolve_auto_differently_raise_on_every_rank_naming_both():
    results = _launch([2, 1])
    for result in results:
        message = result["message"]
        assert message is not None, f"no ValueError: {result}"
        assert not ATTENTION_OPS & set(result["collectives"]), result
        assert "rank 0: ulysses (Ulysses degree 2" in message, message
        assert "rank 1: ring (Ulysses degree 1" in message, message
        assert "'ranks_per_node': 2" in message and "'ranks_per_node': 1" in message, message
        assert "LOCAL_WORLD_SIZE" in message and 'sp_backend="ulysses"' in message, message


def test_ranks_that_agree_run_the_forward():
    results = _launch([2, 2])
    assert [r["backend"] for r in results] == ["ulysses", "ulysses"]
    assert all(r["collectives"].get("all_to_all") for r in results), results  # the attention ran

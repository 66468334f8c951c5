"""`comm.all_gather_rows`: ranks holding different numbers of rows, and the backward's sum over the group."""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed


def gather_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from hf_longctx.distributed.comm import all_gather_rows

    rows = [(r % 3) for r in range(world_size)]  # 0, 1, 2, 0: a rank with none
    x = torch.full((rows[rank], 2), float(rank + 1), dtype=torch.float64, requires_grad=True)
    y = torch.arange(3.0, dtype=torch.float64).repeat(world_size, 1)[:world_size].requires_grad_()  # equal rows
    gx, gy = all_gather_rows([x, y], dist.group.WORLD, check=7)
    weight = torch.arange(1.0, gx.numel() + 1, dtype=torch.float64).view_as(gx) * (rank + 1)  # differs per rank
    (gx * weight).sum().backward(retain_graph=True)
    (gy * (rank + 1)).sum().backward()
    out = {"gx": gx.detach(), "gy": gy.detach(), "x_grad": x.grad, "y_grad": y.grad}
    with pytest.raises(ValueError, match="disagree"):
        all_gather_rows([x.detach()], dist.group.WORLD, check=rank)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_gather_rows_forward_and_backward(world_size):
    results = run_distributed(gather_worker, world_size, timeout=120)
    rows = [(r % 3) for r in range(world_size)]
    want = torch.cat([torch.full((n, 2), float(r + 1), dtype=torch.float64) for r, n in enumerate(rows)])
    scale = sum(range(1, world_size + 1))  # every rank's weight factor, summed by the backward
    offsets = [sum(rows[:r]) for r in range(world_size)]
    for rank, out in enumerate(results):
        assert torch.equal(out["gx"], want) and out["gy"].shape == (world_size * world_size, 3)
        base = torch.arange(1.0, 2 * sum(rows) + 1, dtype=torch.float64).view(-1, 2)
        assert torch.equal(out["x_grad"], scale * base[offsets[rank] : offsets[rank] + rows[rank]])
        assert torch.equal(out["y_grad"], torch.full((world_size, 3), float(scale), dtype=torch.float64))


def unused_outputs_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from hf_longctx.distributed.comm import all_gather_rows
    from hf_longctx.instrument import record_collectives

    rows = [r + 1 for r in range(world_size)]
    xs = [torch.full((rows[rank], 3), float(rank + 1), dtype=torch.float64, requires_grad=True) for _ in range(3)]
    with record_collectives() as stats:
        used, unused, rank0_only = all_gather_rows(xs, dist.group.WORLD)
        loss = used.sum() * (rank + 1) + (rank0_only.sum() if rank == 0 else 0.0)
        loss.backward()
    return {"grads": [x.grad for x in xs], "reduce_scatters": stats.ops["reduce_scatter"].calls}


@pytest.mark.parametrize("world_size", [2])
def test_an_output_no_rank_used_gets_no_reduce_scatter(world_size):
    """A gathered output that no rank's loss reads (a tower's pre-merge hidden state) costs no zero-filled gradient
    and no reduce-scatter; one read on rank 0 only still gives every rank its share."""
    results = run_distributed(unused_outputs_worker, world_size, timeout=120)
    scale = sum(range(1, world_size + 1))
    for rank, out in enumerate(results):
        used, unused, rank0_only = out["grads"]
        assert torch.equal(used, torch.full((rank + 1, 3), float(scale), dtype=torch.float64))
        assert unused is None
        assert torch.equal(rank0_only, torch.ones(rank + 1, 3, dtype=torch.float64))
        assert out["reduce_scatters"] == 2

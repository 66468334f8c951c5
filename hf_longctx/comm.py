"""Communication primitives of the SP path, as autograd functions.

`all_to_all(x, scatter_dim, gather_dim, group)` is the main one: it splits `x` into P equal
chunks along `scatter_dim`, sends chunk `i` to rank `i` and concatenates what it receives along
`gather_dim` in rank order. Its backward is the inverse all-to-all. `all_gather_sequence` is the
non-differentiable gather used for integer metadata (position ids).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .instrument import CollectiveStats, active_recorder, timed_collective


def _all_to_all_forward(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, stats: CollectiveStats | None = None
) -> torch.Tensor:
    ws = dist.get_world_size(group)
    size = x.shape[scatter_dim]
    if size % ws != 0:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {size} is not divisible by the group size {ws}.")
    # [..., ws * c, ...] -> [ws, ..., c, ...]: chunk i (for rank i) becomes contiguous block i.
    send = x.unflatten(scatter_dim, (ws, size // ws)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    with timed_collective("all_to_all", send, (ws - 1) / ws, stats):
        dist.all_to_all_single(recv, send, group=group)
    # recv[j] came from rank j: put the rank axis right before gather_dim and merge them.
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dims, ctx.group, ctx.stats = (scatter_dim, gather_dim), group, active_recorder()
        return _all_to_all_forward(x, scatter_dim, gather_dim, group, ctx.stats)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        # The adjoint of a permutation is its inverse: swap the roles of the two dims.
        return _all_to_all_forward(grad, gather_dim, scatter_dim, ctx.group, ctx.stats), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-to-all: scatter `x` along `scatter_dim`, gather along `gather_dim`.

    Args:
        x: tensor whose `scatter_dim` is divisible by the group size; identical shapes on all ranks.
        scatter_dim: dimension split into one chunk per rank.
        gather_dim: dimension along which received chunks are concatenated in rank order.
        group: the process group; `None` or a group of one rank returns `x` unchanged.

    Returns:
        Tensor with `scatter_dim` divided and `gather_dim` multiplied by the group size.

    Raises:
        ValueError: `scatter_dim` is not divisible by the group size.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Concatenate equal-shaped shards of `x` from every rank of `group` along `dim` (no autograd).

    Args:
        x: the local shard (same shape on every rank).
        group: the process group; `None` returns `x`.
        dim: the sequence dimension.

    Returns:
        The global tensor, shards in rank order.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    ws = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(ws)]
    with timed_collective("all_gather", x, ws - 1):  # each shard reaches ws - 1 ranks
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `x` over `group` out of place and without autograd; `None` returns a copy of `x`."""
    out = x.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        ws = dist.get_world_size(group)
        with timed_collective("all_reduce", out, 2 * (ws - 1) / ws):  # ring all-reduce volume
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out

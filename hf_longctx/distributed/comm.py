"""Every collective hf_longctx issues goes through this module.

`all_to_all(x, scatter_dim, gather_dim, group)` is the main one: it splits `x` into P equal chunks
along `scatter_dim`, sends chunk `i` to rank `i` and concatenates what it receives along
`gather_dim` in rank order; its backward is the inverse all-to-all. The others are
non-differentiable helpers for metadata, checks and metrics. All of them:

- put tensors on a device the group's backend accepts (`group_device`): NCCL only takes CUDA
  tensors, gloo CPU ones, and a CPU tensor handed to NCCL fails at run time on GPU only;
- return results on the caller's device;
- are counted by `instrument.record_collectives` (calls, bytes, seconds);
- raise `failures.CollectiveError` naming the collective and its ranks when a peer dies or times out;
- treat `group=None` (or a group of one rank) as "no communication".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hf_longctx import _compat
from hf_longctx.distributed.failures import collective_failure
from hf_longctx.instrument.measure import CollectiveStats, active_recorder, timed_collective

# Device types each torch.distributed backend accepts; a backend string may list several
# ("cpu:gloo,cuda:nccl" when init_process_group() is called without a backend).
_BACKEND_DEVICES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu"}


def _solo(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def group_device(group: dist.ProcessGroup | None, like: torch.device) -> torch.device:
    """The device a collective on `group` needs for a tensor that lives on `like`.

    `like` itself when the group's backend accepts its device type; otherwise the backend's own
    device (the current CUDA device for NCCL, the CPU for gloo). Unknown backends keep `like`.
    """
    if group is None:
        return like
    parts = [p.split(":")[-1].strip().lower() for p in str(dist.get_backend(group)).split(",")]
    accepted = {_BACKEND_DEVICES[p] for p in parts if p in _BACKEND_DEVICES}
    if not accepted or like.type in accepted:
        return like
    if "cuda" in accepted:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_group(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x.to(group_device(group, x.device)).contiguous()


def _all_to_all_forward(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup, stats: CollectiveStats | None = None
) -> torch.Tensor:
    ws = dist.get_world_size(group)
    size = x.shape[scatter_dim]
    if size % ws != 0:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {size} is not divisible by the group size {ws}.")
    # [..., ws * c, ...] -> [ws, ..., c, ...]: chunk i (for rank i) becomes contiguous block i.
    send = _to_group(x.unflatten(scatter_dim, (ws, size // ws)).movedim(scatter_dim, 0), group)
    if torch.compiler.is_compiling():
        # torch.compile traces functional collectives into the graph; c10d calls would break it.
        recv = funcol.wait_tensor(funcol.all_to_all_single(send.flatten(0, 1), None, None, group)).view_as(send)
        return recv.to(x.device).movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)
    recv = torch.empty_like(send)
    with timed_collective("all_to_all", send, (ws - 1) / ws, stats), collective_failure("all_to_all", group):
        dist.all_to_all_single(recv, send, group=group)
    # recv[j] came from rank j: put the rank axis right before gather_dim and merge them.
    return recv.to(x.device).movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


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
    if _solo(group):
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` (equal shapes), stacked in rank order as `[ws, *x.shape]` (no autograd).

    Args:
        x: the local tensor; every rank of `group` passes the same shape and dtype.
        group: the process group; `None` gives `x.unsqueeze(0)`.

    Returns:
        The stacked tensor, on `x`'s device.
    """
    if _solo(group):
        return x.detach().unsqueeze(0)
    ws = dist.get_world_size(group)
    local = _to_group(x.detach().reshape(1, -1), group)
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_gather_tensor(local, 0, group)).view(ws, *x.shape).to(x.device)
    out = torch.empty((ws, local.shape[1]), dtype=local.dtype, device=local.device)
    # Each shard reaches ws - 1 ranks.
    with timed_collective("all_gather", local, ws - 1), collective_failure("all_gather", group):
        # gloo wants the output as the inputs concatenated along dim 0: flatten each rank's tensor.
        _compat.all_gather_into_tensor()(out, local, group=group)
    return out.view(ws, *x.shape).to(x.device)


def all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Concatenate equal-shaped shards of `x` from every rank of `group` along `dim` (no autograd).

    Args:
        x: the local shard (same shape on every rank).
        group: the process group; `None` returns `x`.
        dim: the sequence dimension.

    Returns:
        The global tensor, shards in rank order.
    """
    if _solo(group):
        return x
    return torch.cat(all_gather_stacked(x, group).unbind(0), dim=dim)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum `x` over `group` out of place and without autograd; `None` returns a copy of `x`."""
    return _all_reduce(x, group, dist.ReduceOp.SUM)


class _GroupSum(torch.autograd.Function):
    """Forward: the sum of `x` over the group. Backward: the incoming gradient times `grad_scale`.

    The exact adjoint of an all-reduce would all-reduce P identical gradients, i.e. multiply by P;
    a constant gives the same result without a collective in backward, and also lets the caller
    pre-compensate the data-parallel engine's gradient average.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, grad_scale: float) -> torch.Tensor:
        ctx.grad_scale = grad_scale
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.grad_scale, None, None


def group_sum(x: torch.Tensor, group: dist.ProcessGroup | None, grad_scale: float) -> torch.Tensor:
    """Differentiable sum of `x` over `group` whose backward scales the gradient by `grad_scale`.

    For a value every rank of the group then uses identically (a loss, a per-row score), the true
    gradient of this rank's partial sum is P times the incoming one; pass `grad_scale=P` (times any
    correction for the engine's average over data-parallel ranks).
    """
    return _GroupSum.apply(x, group, float(grad_scale))


class _GatherRows(torch.autograd.Function):
    """Forward: each tensor's rows from every rank, concatenated in rank order (ranks may hold different
    numbers of rows). Backward: the adjoint, a reduce-scatter: every rank used the whole gathered tensor,
    so the gradient of this rank's rows is the sum over the group of the gradients of those rows.

    Outputs no rank used (a vision tower's pre-merge hidden state beside the merged features) get no zero-filled
    gradient and no reduce-scatter: gradients are not materialised, and one all-reduce of a flag per output tells
    the ranks which outputs any of them used (one rank's unused output still joins the others' reduce-scatter).
    """

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, check: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        local = torch.tensor([check, *(x.shape[0] for x in xs)], dtype=torch.long)
        counts = all_gather_stacked(local, group)  # [ws, 1 + len(xs)]
        if bool((counts[:, 0] != check).any()):
            raise ValueError(
                f"all_gather_rows: the ranks of the group disagree on the input ({counts[:, 0].tolist()})."
            )
        ctx.group, ctx.rank, ctx.counts, ctx.stats = group, rank, counts[:, 1:], active_recorder()
        ctx.set_materialize_grads(False)
        outs = []
        for i, x in enumerate(xs):
            rows = counts[:, i + 1].tolist()
            if min(rows) == max(rows):  # balanced: no padding, and the gathered blocks are the result
                outs.append(all_gather_stacked(x.detach(), group).flatten(0, 1))
                continue
            padded = torch.zeros((max(rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
            padded[: x.shape[0]] = x.detach()
            blocks = all_gather_stacked(padded, group)  # [ws, max rows, ...]
            outs.append(torch.cat([blocks[r, : rows[r]] for r in range(ws)]))
        ctx.shapes = [(out.shape, out.dtype, out.device) for out in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        used = all_reduce_max(torch.tensor([g is not None for g in grads], dtype=torch.int32), ctx.group).tolist()
        out: list[torch.Tensor | None] = []
        for i, grad in enumerate(grads):
            if not used[i]:
                out.append(None)
                continue
            if grad is None:  # another rank used this output: join its reduce-scatter with zeros
                shape, dtype, device = ctx.shapes[i]
                grad = torch.zeros(shape, dtype=dtype, device=device)
            rows = ctx.counts[:, i].tolist()
            if min(rows) == max(rows):
                padded = grad.reshape(len(rows), rows[0], *grad.shape[1:])  # [ws, rows, ...]
            else:
                padded = grad.new_zeros((len(rows), max(rows), *grad.shape[1:]))  # [ws, max rows, ...]
                for r, block in enumerate(grad.split(rows)):
                    padded[r, : rows[r]] = block
            out.append(_reduce_scatter_stacked(padded, ctx.group, ctx.stats)[: rows[ctx.rank]])
        return None, None, *out


def all_gather_rows(xs: list[torch.Tensor], group: dist.ProcessGroup | None, check: int = 0) -> list[torch.Tensor]:
    """Differentiable all-gather of tensors along dim 0, where each rank may hold a different number of rows.

    Args:
        xs: this rank's tensors; every rank passes as many, with equal trailing shapes and dtypes.
        group: the process group; `None` or a group of one rank returns `xs`.
        check: a number every rank must pass equal (e.g. the size of the input they split); checked for free.

    Returns:
        Per tensor, every rank's rows in rank order. Backward gives each rank the sum over the group of the
        gradients of its own rows (the explicit adjoint: torch's gloo all_gather backward is not trusted).

    Raises:
        ValueError: the ranks passed different `check` values.
    """
    if _solo(group) or not xs:
        return list(xs)
    return list(_GatherRows.apply(group, int(check), *xs))


def _reduce_scatter_stacked(
    blocks: torch.Tensor, group: dist.ProcessGroup, stats: CollectiveStats | None
) -> torch.Tensor:
    """`ring_reduce_scatter`, timed and with its failure named (the gather's backward runs it)."""
    ws = dist.get_world_size(group)
    with timed_collective("reduce_scatter", blocks, (ws - 1) / ws, stats), collective_failure("reduce_scatter", group):
        return ring_reduce_scatter(blocks, group)


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Elementwise maximum of `x` over `group`, out of place and without autograd."""
    return _all_reduce(x, group, dist.ReduceOp.MAX)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> torch.Tensor:
    out = _to_group(x.detach().clone(), group)
    if not _solo(group):
        ws = dist.get_world_size(group)
        # Ring all-reduce volume.
        with timed_collective("all_reduce", out, 2 * (ws - 1) / ws), collective_failure("all_reduce", group):
            dist.all_reduce(out, op=op, group=group)
    return out.to(x.device)


def all_gather_object(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order; `[obj]` without a group."""
    if _solo(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    with collective_failure("all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: dist.ProcessGroup | None) -> None:
    """Wait until every rank of `group` arrives (no-op without a group)."""
    if not _solo(group):
        with collective_failure("barrier", group):
            dist.barrier(group=group)


# ---- ring attention's transport (hf_longctx.distributed.ring_comm counts and names these calls) ----


def ring_isend_irecv(
    flat: torch.Tensor, nxt: int, prv: int, group: dist.ProcessGroup, tag: int
) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Start sending `flat` to global rank `nxt` and receiving its shape from `prv`.

    Returns the works, the send buffer (kept alive until they finish) and the receive buffer, both on
    the group's device: the caller waits, then moves the received buffer to its own device.
    """
    send = _to_group(flat, group)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return dist.batch_isend_irecv(ops), send, recv


def ring_all_gather(flat: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[ws, *flat.shape]`: every rank's `flat` in group-rank order, on `flat`'s device."""
    local = _to_group(flat, group)
    out = torch.empty((dist.get_world_size(group), *flat.shape), dtype=local.dtype, device=local.device)
    dist.all_gather(list(out.unbind(0)), local, group=group)
    return out.to(flat.device)


def ring_reduce_scatter(blocks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over the group of `blocks[rank]` (`blocks` is `[ws, ...]`), on `blocks`' device.

    NCCL has a reduce-scatter; gloo does not, so there the blocks travel by all-to-all (each chunk
    contiguous) and are summed.
    """
    local = _to_group(blocks, group)
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(local[0])
        dist.reduce_scatter_tensor(out, local, group=group)
    else:
        recv = torch.empty_like(local)
        dist.all_to_all_single(recv, local, group=group)
        out = recv.sum(0)
    return out.to(blocks.device)

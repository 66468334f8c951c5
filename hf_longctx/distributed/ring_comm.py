"""Communication of ring attention: pass a buffer to the next rank of a ring, all-gather, reduce-scatter.

`RingComm` describes one ring (its process group, this rank's place and the *global* ranks in ring
order: point-to-point calls address global ranks, which differ from group ranks in the rings of a
hybrid layout). `RingComm.exchange(flat)` is the main call: it sends a flat buffer to the next rank
and receives the previous rank's one asynchronously, so the next block travels while the current one
computes. No function here takes part in autograd: ring.py's autograd functions call them in both
passes. Every call is counted by `hf_longctx.instrument` (op names "ring_p2p", "ring_all_gather",
"ring_reduce_scatter"), bytes being what this rank sends to other ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hf_longctx.distributed import comm
from hf_longctx.distributed.failures import collective_failure
from hf_longctx.instrument.measure import CollectiveStats, active_recorder


def _record(stats: CollectiveStats | None, op: str, nbytes: int, seconds: float) -> None:
    stats = stats if stats is not None else active_recorder()
    if stats is not None:
        stats.add(op, nbytes, seconds)


class Pending:
    """An exchange in flight; `wait()` returns the received buffer (and counts the call)."""

    def __init__(
        self,
        works: list,
        recv: torch.Tensor,
        nbytes: int,
        stats: CollectiveStats | None,
        start: float,
        group: dist.ProcessGroup | None = None,
        keep: tuple[torch.Tensor, ...] = (),
        device: torch.device | None = None,
    ):
        self._works, self._recv, self._nbytes, self._stats, self._start = works, recv, nbytes, stats, start
        self._group, self._keep, self._device = group, keep, device or recv.device

    def wait(self) -> torch.Tensor:
        with collective_failure("ring_p2p", self._group):  # a dead peer surfaces here, not at the send
            for work in self._works:
                work.wait()
        if self._works:
            _record(self._stats, "ring_p2p", self._nbytes, time.perf_counter() - self._start)
        self._works, self._keep = [], ()
        self._recv = self._recv.to(self._device)  # from the group's device (the host for gloo) back
        return self._recv


@dataclass(frozen=True)
class RingComm:
    """One ring: `size` ranks, this one at `rank`; `ranks[i]` is the global rank of ring rank i."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    ranks: tuple[int, ...]

    @classmethod
    def local(cls) -> RingComm:
        """A ring of one rank (no communication): ring attention degenerates to local attention."""
        return cls(group=None, rank=0, size=1, ranks=(0,))

    def exchange(self, flat: torch.Tensor, tag: int, stats: CollectiveStats | None = None) -> Pending:
        """Send `flat` to ring rank `rank + 1`, receive the same shape from `rank - 1` (async).

        Args:
            flat: a contiguous buffer, identical in shape and dtype on every rank.
            tag: distinguishes exchanges in flight at once between the same two ranks (gloo matches
                messages by tag; NCCL by issue order, which is the same on every rank here).
            stats: the recorder to count into (autograd backward threads pass the forward's).
        """
        if self.size == 1:
            return Pending([], flat, 0, stats, 0.0)
        nxt, prv = self.ranks[(self.rank + 1) % self.size], self.ranks[(self.rank - 1) % self.size]
        start = time.perf_counter()
        with collective_failure("ring_p2p", self.group):
            works, send, recv = comm.ring_isend_irecv(flat, nxt, prv, self.group, tag)
        nbytes = flat.numel() * flat.element_size()
        return Pending(works, recv, nbytes, stats, start, self.group, keep=(send,), device=flat.device)

    def all_gather(self, flat: torch.Tensor, stats: CollectiveStats | None = None) -> torch.Tensor:
        """`[size, *flat.shape]`: every ring rank's `flat`, in ring order."""
        if self.size == 1:
            return flat.unsqueeze(0)
        start = time.perf_counter()
        with collective_failure("ring_all_gather", self.group):
            out = comm.ring_all_gather(flat, self.group)
        _record(
            stats, "ring_all_gather", flat.numel() * flat.element_size() * (self.size - 1), time.perf_counter() - start
        )
        return out

    def reduce_scatter(self, blocks: torch.Tensor, stats: CollectiveStats | None = None) -> torch.Tensor:
        """Sum of `blocks[rank]` over the ring: `blocks` is `[size, ...]`, block i goes to ring rank i.

        `comm.ring_reduce_scatter` moves the blocks: by reduce-scatter on NCCL, by all-to-all on gloo
        (each chunk contiguous: `torch.distributed.nn.functional.all_gather`'s gloo backward, which
        hands non-contiguous chunks to the exchange, gave wrong gradients for some shapes).
        """
        if self.size == 1:
            return blocks[0]
        blocks = blocks.contiguous()
        nbytes = blocks[0].numel() * blocks.element_size() * (self.size - 1)
        start = time.perf_counter()
        with collective_failure("ring_reduce_scatter", self.group):
            out = comm.ring_reduce_scatter(blocks, self.group)
        _record(stats, "ring_reduce_scatter", nbytes, time.perf_counter() - start)
        return out


def ring_of(group: dist.ProcessGroup | None, ranks: tuple[int, ...] | None = None) -> RingComm:
    """The `RingComm` of `group` (its global ranks in group-rank order unless `ranks` is given)."""
    if group is None or dist.get_world_size(group) == 1:
        return RingComm.local()
    size = dist.get_world_size(group)
    ranks = ranks or tuple(dist.get_global_rank(group, i) for i in range(size))
    return RingComm(group=group, rank=dist.get_rank(group), size=size, ranks=tuple(ranks))

"""Sequence-parallel and data-parallel process groups.

`SequenceParallelGroups.build(sp_size)` is the main entry: it is called once, after
`torch.distributed` is initialised, and the resulting object is passed explicitly to every
function that communicates. Contiguous ranks form one SP group, so an SP group stays inside a
node whenever `sp_size` divides the number of GPUs per node.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from hf_longctx import _compat
from hf_longctx.distributed.failures import resolve_timeout
from hf_longctx.distributed.layout_slot import LayoutSlot


def validate_sp_size(sp_size: int, world_size: int | None = None) -> None:
    """Raise a `ValueError` naming the fix when `sp_size` is not a valid SP degree for `world_size` ranks.

    Args:
        sp_size: requested sequence-parallel degree.
        world_size: number of ranks in the job; None checks `sp_size` alone (before launch).

    Raises:
        ValueError: `sp_size` is not a positive integer or does not divide `world_size`.
    """
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sp_size must be an integer >= 1, got {sp_size!r}.")
    if world_size is not None and world_size % sp_size != 0:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"sp_size={sp_size} does not divide the world size {world_size}; "
            f"choose sp_size in {valid} or launch a multiple of {sp_size} processes."
        )


@dataclass(frozen=True)
class SequenceParallelGroups:
    """The SP group this rank belongs to and the DP group of ranks with the same SP rank.

    Ranks `[i * sp, (i + 1) * sp)` form SP group `i` (they share one sample and each keep a slice
    of its sequence); ranks with the same `sp_rank` form a DP group (they read different samples).
    """

    sp_group: dist.ProcessGroup | None
    sp_rank: int
    sp_world_size: int
    dp_group: dist.ProcessGroup | None
    dp_rank: int
    dp_world_size: int
    # Ranks per node (torchrun's LOCAL_WORLD_SIZE), None if unknown: hybrid/auto keep Ulysses inside a node.
    ranks_per_node: int | None = None
    # The token layout the enabled backend expects (layout_slot.py); read by shard_batch and the collator.
    layout_slot: LayoutSlot = field(default_factory=LayoutSlot, compare=False, repr=False)
    # 2-D (Ulysses x ring) groups, created collectively on first use and kept: {ulysses_degree: HybridGroups}.
    _hybrid: dict[int, HybridGroups] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, sp_size: int, timeout: datetime.timedelta | float | None = None) -> SequenceParallelGroups:
        """Create the SP and DP groups; every rank of the job must call this collectively.

        Args:
            sp_size: sequence-parallel degree; must divide the world size.
            timeout: how long a collective on these groups may wait for a peer (seconds or a timedelta)
                before it raises (gloo) or the watchdog aborts the process (NCCL); None follows the
                default process group's, i.e. what `init_process_group(timeout=...)` was given.

        Returns:
            The groups of the calling rank.

        Raises:
            ValueError: `torch.distributed` is not initialised, `sp_size` is invalid, or `timeout` <= 0.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group() "
                "(or launch with torchrun / accelerate launch) before SequenceParallelGroups.build()."
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        validate_sp_size(sp_size, world)
        timeout = resolve_timeout(timeout)
        dp_size = world // sp_size
        sp_group = dp_group = None
        # Every rank must take part in creating every group, in the same order.
        for i in range(dp_size):
            ranks = list(range(i * sp_size, (i + 1) * sp_size))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                sp_group = group
        for j in range(sp_size):
            ranks = list(range(j, world, sp_size))
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                dp_group = group
        return cls(
            sp_group=sp_group,
            sp_rank=rank % sp_size,
            sp_world_size=sp_size,
            dp_group=dp_group,
            dp_rank=rank // sp_size,
            dp_world_size=dp_size,
            ranks_per_node=local_world_size(),
        )

    @classmethod
    def single(cls) -> SequenceParallelGroups:
        """Groups for a single process without `torch.distributed` (SP=1, DP=1): the reference run."""
        return cls(sp_group=None, sp_rank=0, sp_world_size=1, dp_group=None, dp_rank=0, dp_world_size=1)

    def process_groups(self) -> list[dist.ProcessGroup]:
        """Every process group of this rank these groups own: SP, DP and the hybrid (Ulysses, ring) ones."""
        hybrid = [g for h in self._hybrid.values() for g in (h.ulysses_group, h.ring_group)]
        return list({id(g): g for g in (self.sp_group, self.dp_group, *hybrid) if g is not None}.values())

    def destroy(self) -> None:
        """Destroy the SP, DP and hybrid groups of this rank (local: other ranks destroy theirs themselves).

        Safe to call twice and after `torch.distributed` itself was shut down.
        """
        groups = self.process_groups()
        self._hybrid.clear()
        for group in groups:
            if not dist.is_initialized():
                continue
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already destroyed (e.g. with the default group)
                pass

    @property
    def sp_enabled(self) -> bool:
        """True when sequences are split across more than one rank."""
        return self.sp_world_size > 1

    @property
    def layout(self) -> str:
        """The token layout ("contiguous" or "zigzag") that `shard_batch(batch, groups)` produces."""
        return self.layout_slot.kind

    def hybrid(self, ulysses_degree: int) -> HybridGroups:
        """The Ulysses x ring groups of this SP group for `ulysses_degree` (built once, collectively).

        Every rank of the job must call this with the same degree in the same order (it creates
        process groups). Ulysses groups are consecutive ranks, so with `ulysses_degree` dividing the
        ranks per node every all-to-all stays inside a node and ring hops cross nodes.

        Raises:
            ValueError: `ulysses_degree` does not divide the SP size.
        """
        if ulysses_degree not in self._hybrid:
            self._hybrid[ulysses_degree] = self._build_hybrid(ulysses_degree)
        return self._hybrid[ulysses_degree]

    def _build_hybrid(self, ulysses_degree: int) -> HybridGroups:
        world = self.dp_world_size * self.sp_world_size
        ulysses, ring = hybrid_rank_grid(world, self.sp_world_size, ulysses_degree)
        rank = dist.get_rank() if self.sp_enabled else 0
        sp_ranks = tuple(range(rank - self.sp_rank, rank - self.sp_rank + self.sp_world_size))
        if ulysses_degree in (1, self.sp_world_size):
            # One of the two axes is the whole SP group and the other is trivial: no new groups.
            whole, single = (self.sp_group, sp_ranks), (None, (rank,))
            (u_group, u_ranks), (r_group, r_ranks) = (single, whole) if ulysses_degree == 1 else (whole, single)
        else:
            found = {}
            for name, grid in (("ulysses", ulysses), ("ring", ring)):
                for ranks in grid:  # every rank creates every group, in the same order
                    group = dist.new_group(ranks, timeout=_compat.group_timeout(self.sp_group))
                    if rank in ranks:
                        found[name] = (group, tuple(ranks))
            (u_group, u_ranks), (r_group, r_ranks) = found["ulysses"], found["ring"]
        return HybridGroups(
            ulysses_group=u_group,
            ulysses_rank=u_ranks.index(rank),
            ulysses_size=len(u_ranks),
            ulysses_ranks=u_ranks,
            ring_group=r_group,
            ring_rank=r_ranks.index(rank),
            ring_size=len(r_ranks),
            ring_ranks=r_ranks,
        )

    def ulysses_view(self, hybrid: HybridGroups) -> SequenceParallelGroups:
        """The Ulysses group of `hybrid` as groups of its own (what the Ulysses exchange takes)."""
        return SequenceParallelGroups(
            sp_group=hybrid.ulysses_group,
            sp_rank=hybrid.ulysses_rank,
            sp_world_size=hybrid.ulysses_size,
            dp_group=None,
            dp_rank=0,
            dp_world_size=1,
            ranks_per_node=self.ranks_per_node,
        )


@dataclass(frozen=True)
class HybridGroups:
    """One rank's place in the Ulysses x ring decomposition of its SP group (SP rank = ring rank x U +
    Ulysses rank). `ulysses_ranks` / `ring_ranks` are the global ranks of the two groups, in group order."""

    ulysses_group: dist.ProcessGroup | None
    ulysses_rank: int
    ulysses_size: int
    ulysses_ranks: tuple[int, ...]
    ring_group: dist.ProcessGroup | None
    ring_rank: int
    ring_size: int
    ring_ranks: tuple[int, ...]


def hybrid_rank_grid(world_size: int, sp_size: int, ulysses_degree: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of every Ulysses group and every ring group (pure; no process group needed).

    SP group i holds ranks `[i * sp, (i + 1) * sp)`; inside it, Ulysses groups are runs of
    `ulysses_degree` consecutive ranks and ring groups take one rank of each run (stride
    `ulysses_degree`), the "Ulysses inner" placement of USP (arXiv 2405.07719).

    Raises:
        ValueError: `ulysses_degree` does not divide `sp_size`, or `sp_size` does not divide `world_size`.
    """
    validate_sp_size(sp_size, world_size)
    if not isinstance(ulysses_degree, int) or ulysses_degree < 1 or sp_size % ulysses_degree:
        valid = [d for d in range(1, sp_size + 1) if sp_size % d == 0]
        raise ValueError(f"ulysses_degree={ulysses_degree!r} must divide sp_size={sp_size}; choose one of {valid}.")
    ring_size = sp_size // ulysses_degree
    ulysses, ring = [], []
    for base in range(0, world_size, sp_size):
        ulysses += [[base + j * ulysses_degree + u for u in range(ulysses_degree)] for j in range(ring_size)]
        ring += [[base + j * ulysses_degree + u for j in range(ring_size)] for u in range(ulysses_degree)]
    return ulysses, ring


def local_world_size() -> int | None:
    """Ranks on this node as torchrun / accelerate launch export it (LOCAL_WORLD_SIZE), or None.

    Read once when the groups are built: it is a fact about the launch, not a switch.
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


def host_id() -> int:
    """This host as a non-negative int64 (a hash of its name): host names ride along in an all-gather of int64
    tensors, so finding which ranks share a host costs no collective of its own."""
    return int.from_bytes(hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest(), "big")


def all_to_all_across_hosts(hosts: Sequence[int], sp_size: int, ulysses_degree: int) -> list[list[int]]:
    """The Ulysses groups (the ranks of one all-to-all) whose ranks run on more than one host (pure).

    Args:
        hosts: each global rank's host (`host_id()`), in rank order.
        sp_size: the SP size.
        ulysses_degree: ranks per all-to-all: `sp_size` for Ulysses, fewer for hybrid, 1 for ring (none).

    Returns:
        The global ranks of each such group, in `hybrid_rank_grid` order; empty when every all-to-all stays on one
        host.
    """
    if ulysses_degree < 2:
        return []
    ulysses, _ = hybrid_rank_grid(len(hosts), sp_size, ulysses_degree)
    return [ranks for ranks in ulysses if len({hosts[r] for r in ranks}) > 1]

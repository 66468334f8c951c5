"""Sequence-parallel and data-parallel process groups.

`SequenceParallelGroups.build(sp_size)` is the main entry: it is called once, after
`torch.distributed` is initialised, and the resulting object is passed explicitly to every
function that communicates. Contiguous ranks form one SP group, so an SP group stays inside a
node whenever `sp_size` divides the number of GPUs per node.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from .failures import resolve_timeout


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
        )

    @classmethod
    def single(cls) -> SequenceParallelGroups:
        """Groups for a single process without `torch.distributed` (SP=1, DP=1): the reference run."""
        return cls(sp_group=None, sp_rank=0, sp_world_size=1, dp_group=None, dp_rank=0, dp_world_size=1)

    def destroy(self) -> None:
        """Destroy the SP and DP groups of this rank (local: other ranks destroy theirs themselves).

        Safe to call twice and after `torch.distributed` itself was shut down.
        """
        for group in (self.sp_group, self.dp_group):
            if group is None or not dist.is_initialized():
                continue
            try:
                dist.destroy_process_group(group)
            except (ValueError, RuntimeError):  # already destroyed (e.g. with the default group)
                pass

    @property
    def sp_enabled(self) -> bool:
        """True when sequences are split across more than one rank."""
        return self.sp_world_size > 1

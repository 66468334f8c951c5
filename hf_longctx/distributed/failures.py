"""What a rank does when a collective cannot complete: a bounded wait and an error that says where.

A rank that dies (killed, out of memory, a crashed node) or stops responding leaves its peers inside a
collective. `collective_failure(op, group)` wraps every collective `hf_longctx.distributed.comm` issues and turns a
backend error into a `CollectiveError` naming the collective, the global ranks of the group, this rank
and the group's timeout. How long a peer can wait is the group's timeout: hf_longctx's SP and DP groups
follow the default process group's (`resolve_timeout`), i.e. `init_process_group(timeout=...)`, which the
Trainer sets from `TrainingArguments.ddp_timeout` (`apply_timeout` also applies it on CPU, where
transformers does not pass it on).
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterable, Iterator

import torch.distributed as dist

from hf_longctx import _compat


class CollectiveError(RuntimeError):
    """A collective failed on this rank because a peer died, stopped responding or timed out."""


def _describe(group: dist.ProcessGroup) -> tuple[list[int], str]:
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):  # the group is already gone
        ranks = []
    timeout = _compat.group_timeout(group)
    return ranks, f"{timeout.total_seconds():g} s" if timeout is not None else "unknown"


@contextlib.contextmanager
def collective_failure(op: str, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Re-raise a failure of the collective `op` on `group` as a `CollectiveError` that says where.

    gloo raises at once when a peer's connection closes (a dead process) and after the group timeout
    when a peer stops responding; NCCL's watchdog aborts the process after the timeout instead, so on
    NCCL this message appears only where the error reaches Python.
    """
    start = time.monotonic()
    try:
        yield
    except RuntimeError as exc:
        if group is None:
            raise
        ranks, timeout = _describe(group)
        rank = dist.get_rank() if dist.is_initialized() else -1
        raise CollectiveError(
            f"hf_longctx: {op} over global ranks {ranks} failed on rank {rank} after "
            f"{time.monotonic() - start:.1f} s (group timeout {timeout}). A peer of this collective crashed, was "
            "killed or stopped responding; the launcher's log (torchrun: 'Root Cause') names the rank that "
            f"failed first. Backend error: {exc}"
        ) from exc


def resolve_timeout(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """The timeout for a new hf_longctx group: `timeout` (seconds or a timedelta), else the default group's.

    `torch.distributed.new_group(timeout=None)` uses the backend's constant (30 min on gloo, 10 min on
    NCCL), not the timeout the job chose in `init_process_group`; hf_longctx's groups follow the job's.
    """
    if timeout is None:
        return _compat.group_timeout(None)
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}.")
    return datetime.timedelta(seconds=timeout)


def apply_timeout(groups: Iterable[dist.ProcessGroup | None], seconds: float) -> None:
    """Give every group (None = the default group) a timeout of `seconds`; groups that already have it are left."""
    timeout = datetime.timedelta(seconds=seconds)
    for group in groups:
        if _compat.group_timeout(group) not in (None, timeout):
            _compat.set_group_timeout(group, timeout)

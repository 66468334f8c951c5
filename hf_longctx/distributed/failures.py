"""What a rank does when a collective cannot complete: a bounded wait and an error that says where.

A rank that dies (killed, out of memory, a crashed node) or stops responding leaves its peers inside a
collective. `collective_failure(op, group)` wraps every collective `hf_longctx.distributed.comm` issues and turns a
backend error into a `CollectiveError` naming the collective, the global ranks of the group, this rank
and the group's timeout. How long a peer can wait is the group's timeout: hf_longctx's SP and DP groups
follow the default process group's (`resolve_timeout`), i.e. `init_process_group(timeout=...)`, which the
Trainer sets from `TrainingArguments.ddp_timeout` (`apply_timeout` also applies it on CPU, where
transformers does not pass it on).

At exit `shutdown_process_groups` tears the groups down within a bound: `destroy_process_group` flushes
pending work first, which on NCCL after a failure waits for a dead peer until the watchdog fires (the
group timeout, 900 s in the GPU recipes); past the bound, or at once after a collective failed here, the
groups are aborted instead.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch.distributed as dist

from hf_longctx import _compat

logger = logging.getLogger(__name__)
# How long an exiting rank lets destroy_process_group (then abort) run before it gives up on it. A healthy
# destroy takes milliseconds; only a dead or stuck peer makes it wait.
SHUTDOWN_DEADLINE_S = 30.0
_FAILED: list[str] = []  # the collectives that failed on this rank (see shutdown_process_groups)


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
        _FAILED.append(op)
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


def _bounded(step: str, fn: Callable[[], None], deadline_s: float) -> bool:
    """Run `fn` in a daemon thread; True when it returned within `deadline_s` seconds without raising."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except Exception as exc:  # reported below, on the calling thread
            errors.append(exc)

    thread = threading.Thread(target=target, name=f"hf_longctx-{step}", daemon=True)
    thread.start()
    thread.join(deadline_s)
    if thread.is_alive():
        logger.warning("hf_longctx: %s of the process groups did not return within %g s", step, deadline_s)
        return False
    if errors:
        logger.warning("hf_longctx: %s of the process groups failed: %s", step, errors[0])
        return False
    return True


def shutdown_process_groups(deadline_s: float | None = None) -> bool:
    """Destroy every process group of this process, waiting at most `deadline_s` (default
    `SHUTDOWN_DEADLINE_S`) per step.

    After a collective failed on this rank the groups are aborted at once (a destroy would wait for the
    dead peer); otherwise they are destroyed, and aborted if the destroy does not return in time. A step
    still stuck past its deadline is left to its daemon thread and the process exits anyway.

    Returns:
        True when the groups were torn down (destroyed or aborted), False when every step gave up.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return True
    deadline_s = SHUTDOWN_DEADLINE_S if deadline_s is None else deadline_s
    steps: list[tuple[str, Callable[[], None]]] = [("abort", _compat.abort_process_groups)]
    if _FAILED:
        logger.warning("hf_longctx: %s failed on this rank; aborting the process groups at exit", _FAILED[0])
    else:
        steps.insert(0, ("destroy", dist.destroy_process_group))
    for step, fn in steps:
        if _bounded(step, fn, deadline_s):
            return True
    logger.error("hf_longctx: the process groups could not be shut down; exiting without it")
    return False

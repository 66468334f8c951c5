"""Launch gloo ranks that may die or freeze on purpose, and report how each one ended.

`launch(fn, world_size, ...)` is the one entry. Unlike `tests._dist.run_distributed`, nothing is
killed when a rank fails: survivors of an injected fault must end by themselves, and the outcome of
every rank (its result, the error it raised and when, its exit code, when the parent saw it exit)
comes back so a test can assert how fast and how they ended. Ranks listed in `faulty` (a frozen
rank never ends) are killed once every other rank has ended; anything still running at `timeout`
is killed and reported as hung.

Ranks are forked from the session's forkserver (`tests._dist.forkserver_context`), which imported torch,
transformers and the Trainer once.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from tests._dist import CHILD_ENV, _child_environment, forkserver_context

_POLL_S = 0.05


@dataclass
class RankOutcome:
    """How one rank ended. Times are `time.time()` (comparable across processes of this machine)."""

    rank: int
    exitcode: int | None  # negative: killed by that signal; None: still running at the deadline
    result: Any = None  # fn's return value when it returned
    error: str | None = None  # the traceback of what fn raised
    error_time: float | None = None  # when fn raised
    exit_time: float | None = None  # when the parent saw the process end
    hung: bool = False  # killed by the harness at the deadline

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.error is None


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float,
    pg_timeout_s: float = 60.0,
    faulty: Iterable[int] = (),
    **kwargs: Any,
) -> list[RankOutcome]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked gloo ranks.

    Args:
        fn: a module-level function (pickled by reference).
        world_size: number of ranks.
        timeout: seconds after which every rank still running is killed and reported `hung`.
        pg_timeout_s: timeout of the default process group (what `init_process_group(timeout=)` sets).
        faulty: ranks expected not to end by themselves (frozen on purpose): killed once all others ended.

    Returns:
        One `RankOutcome` per rank, in rank order.
    """
    ctx = forkserver_context()
    store_dir = tempfile.mkdtemp(prefix="hf_longctx_faults_")
    init_method = f"file://{os.path.join(store_dir, 'store')}"
    procs: list[Any] = []
    readers: list[Connection] = []
    try:
        with _child_environment():
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker,
                    args=(fn, rank, world_size, init_method, pg_timeout_s, writer, args, kwargs),
                    name=f"faults-rank{rank}",
                    daemon=True,
                )
                proc.start()
                writer.close()
                procs.append(proc)
                readers.append(reader)
        return _watch(procs, readers, timeout, set(faulty))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for reader in readers:
            reader.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _watch(procs: list[Any], readers: list[Connection], timeout: float, faulty: set[int]) -> list[RankOutcome]:
    deadline = time.monotonic() + timeout
    outcomes = [RankOutcome(rank=r, exitcode=None) for r in range(len(procs))]
    running = set(range(len(procs)))
    while running:
        if time.monotonic() > deadline or running <= faulty:
            for rank in running:
                procs[rank].kill()
                procs[rank].join(5)
                outcomes[rank].hung = rank not in faulty
            break
        wait([readers[r] for r in running] + [procs[r].sentinel for r in running], timeout=_POLL_S)
        for rank in sorted(running):
            _read(readers[rank], outcomes[rank])
            if not procs[rank].is_alive():
                outcomes[rank].exit_time = time.time()
                procs[rank].join()
                outcomes[rank].exitcode = procs[rank].exitcode
                _read(readers[rank], outcomes[rank])
                running.discard(rank)
    return outcomes


def _read(reader: Connection, outcome: RankOutcome) -> None:
    try:
        if not reader.poll():
            return
        status, payload, when = pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        return
    if status == "ok":
        outcome.result = payload
    else:
        outcome.error, outcome.error_time = payload, when


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    pg_timeout_s: float,
    writer: Connection,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Forked entry point: init gloo, run `fn`, report, and leave at once (no waiting for peers)."""
    os.environ.update(CHILD_ENV)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        result = fn(rank, world_size, *args, **kwargs)
        # A rank that returns stays until every rank has: leaving early would break a peer's last collective.
        dist.barrier()
        message = ("ok", result, time.time())
    except BaseException:
        message = ("error", traceback.format_exc(), time.time())
    writer.send_bytes(pickle.dumps(message))
    writer.close()
    if message[0] == "error":
        sys.exit(1)

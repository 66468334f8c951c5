"""The one helper for multi-process tests: `run_distributed` starts `world_size` gloo ranks on CPU.

Each rank runs `fn(rank, world_size, *args, **kwargs)` with `torch.distributed` initialised (gloo,
`file://` store in a fresh temp dir, loopback only, one thread). Return values come back ordered by
rank; a worker exception is re-raised in the parent as `RuntimeError` with the rank and traceback;
a hang is killed after `timeout` seconds and reported as `TimeoutError` naming the ranks still running.

Ranks are forked from a multiprocessing forkserver (`forkserver_context`, shared with `tests/_faults.py`)
that imported torch, transformers and the Trainer once per session: a spawned rank paid those imports,
several CPU seconds per process on the 2-core CI machine, at every launch of the suite. A forked rank
starts from that clean, freshly imported state, as a spawned one did.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = Path(__file__).resolve().parent.parent

# Loopback-only gloo and one thread per rank, like accelerate's `debug_launcher`: the CI machine has 2 cores.
CHILD_ENV = {
    "MASTER_ADDR": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
}

# What the forkserver imports once per session (before any test changes state): every rank forks from it.
PRELOAD = [
    "torch",
    "transformers",
    "transformers.trainer",
    "accelerate",
    "datasets",
    "hf_longctx",
    "hf_longctx.integrations.trainer",
    "tests._models",
    "tests.dist._trainer_utils",
    "tests.dist._sft_utils",
]
_CONTEXT: list[Any] = []

_OK = "ok"
_ERROR = "error"
_POLL_S = 0.5
_KILL_GRACE_S = 5.0


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` spawned gloo ranks.

    Args:
        fn: a module-level (picklable) function; the ranks import it by qualified name,
            e.g. `tests.dist.test_x.my_worker`.
        world_size: number of ranks (processes) to spawn.
        *args, **kwargs: passed to `fn` after `rank, world_size`; must be picklable. `timeout` is
            reserved for this helper.
        timeout: seconds, counted from spawning, after which every worker is killed.

    Returns:
        The return values of `fn` (picklable), as a list ordered by rank.

    Raises:
        ValueError: `world_size < 1` or `fn` cannot be pickled (e.g. a lambda or nested function).
        RuntimeError: a worker raised (message has the rank and its full traceback) or died without
            reporting; all other workers are terminated first.
        TimeoutError: `timeout` elapsed; all workers are killed and the message names the ranks that
            had not finished.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(
            f"run_distributed: {fn!r} cannot be pickled for the spawned workers; define it at module "
            f"level in an importable module (e.g. tests/dist/test_x.py): {exc}"
        ) from exc

    ctx = forkserver_context()
    store_dir = tempfile.mkdtemp(prefix="hf_longctx_dist_")
    init_method = f"file://{os.path.join(store_dir, 'store')}"
    # Workers that finished keep their process group alive until this event: a rank that exits early
    # would otherwise turn a peer's hang into a "connection reset" error and hide the real desync.
    release = ctx.Event()
    procs: list[Any] = []
    readers: list[Connection] = []
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        with _child_environment():
            for rank in range(world_size):
                reader, writer = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker,
                    args=(fn, rank, world_size, init_method, release, writer, args, kwargs, timeout),
                    name=f"run_distributed-rank{rank}",
                    daemon=True,
                )
                proc.start()
                # Close the parent's copy so that a dead worker shows up as EOF on `reader`.
                writer.close()
                procs.append(proc)
                readers.append(reader)

        results = _collect(procs, readers, timeout, name)
        release.set()
        for proc in procs:
            proc.join(_KILL_GRACE_S)
        return results
    finally:
        _kill_all(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def value_errors(
    scenarios: dict[str, Callable[[], Any]], after_each: Callable[[], None] | None = None
) -> dict[str, dict[str, Any]]:
    """Run each scenario in this rank; per name, the `ValueError` message it raised (None if none) and the
    collectives hf_longctx issued before it (op -> calls): a refusal must come before any attention collective."""
    from hf_longctx.instrument import record_collectives

    out = {}
    for name, call in scenarios.items():
        message = None
        with record_collectives() as stats:
            try:
                call()
            except ValueError as exc:
                message = str(exc)
        out[name] = {"message": message, "collectives": {op: s.calls for op, s in stats.ops.items()}}
        if after_each is not None:
            after_each()
    return out


def forkserver_context() -> Any:
    """The session's multiprocessing context: a forkserver with `PRELOAD` imported.

    The server starts with the first process started under `_child_environment` (every caller starts its
    ranks there), so it, and every rank forked from it, has `CHILD_ENV` and the repo on `PYTHONPATH`.
    """
    if not _CONTEXT:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(ctx)
    return _CONTEXT[0]


def _collect(procs: list[Any], readers: list[Connection], timeout: float, name: str) -> list[Any]:
    """Wait for one message per rank; raise on the first error, a dead worker or the deadline."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    pending = set(range(world_size))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            running = sorted(pending)
            finished = sorted(results)
            _kill_all(procs)
            raise TimeoutError(
                f"run_distributed({name}, world_size={world_size}) timed out after {timeout:g} s; "
                f"ranks still running: {running} (finished: {finished}); all workers were killed. "
                "A rank is probably blocked in a collective its peers never joined."
            )
        wait([readers[r] for r in pending], timeout=min(_POLL_S, remaining))
        errors: list[str] = []
        for rank in sorted(pending):
            message = _receive(readers[rank], procs[rank], rank, world_size)
            if message is None:
                continue
            pending.discard(rank)
            status, payload = message
            if status == _OK:
                results[rank] = payload
            else:
                errors.append(payload)
        if errors:
            _kill_all(procs)
            raise RuntimeError(f"run_distributed({name}, world_size={world_size}) failed:\n\n" + "\n\n".join(errors))
    return [results[rank] for rank in range(world_size)]


def _receive(reader: Connection, proc: Any, rank: int, world_size: int) -> tuple[str, Any] | None:
    """One decoded message from `rank`, an error message if it died silently, or None if not ready."""
    if not reader.poll():
        return None
    try:
        return pickle.loads(reader.recv_bytes())
    except EOFError:
        proc.join(_KILL_GRACE_S)
        return (
            _ERROR,
            f"rank {rank} of {world_size} exited with code {proc.exitcode} before reporting a result "
            "(killed, crashed or called os._exit)",
        )
    except Exception:
        text = traceback.format_exc()
        return (_ERROR, f"rank {rank} of {world_size}: could not decode its result:\n{text}")


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    release: Any,
    writer: Connection,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
) -> None:
    """Forked entry point: init gloo, run `fn`, send the pickled outcome, wait for release."""
    parent_pid = os.getppid()
    try:
        os.environ.update(CHILD_ENV)
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
        )
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args, **kwargs)
        data = pickle.dumps((_OK, result))
    except BaseException:
        text = traceback.format_exc()
        data = pickle.dumps((_ERROR, f"rank {rank} of {world_size} raised:\n{text}"))
    try:
        writer.send_bytes(data)
    finally:
        writer.close()
    # Stay in the group until every rank is done (or the parent kills us, or the parent is gone).
    deadline = time.monotonic() + timeout + 2 * _KILL_GRACE_S
    while not release.wait(_POLL_S):
        if os.getppid() != parent_pid or time.monotonic() > deadline:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _kill_all(procs: list[Any]) -> None:
    """Terminate, then kill, every worker still alive; never blocks for long."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(_KILL_GRACE_S)


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """Set the children's environment around `start()` and restore the parent's afterwards.

    OMP_NUM_THREADS must be in the environment before the child imports torch, and PYTHONPATH holds the
    repo root so that the child can import `fn` by reference (`tests.dist.test_x`).
    """
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    updates = {**CHILD_ENV, "PYTHONPATH": pythonpath}
    saved = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

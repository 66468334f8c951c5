"""One spawn per world size for the ring suites (test_ring_ops.py, test_ring_parity.py): spawning and
importing transformers costs more than most cases, so the operator cases, the communication-volume runs,
the model-level parity combinations and (world 2) the feature checks share it; results are cached here
for the session and a failure is re-raised by every dependent test."""

from __future__ import annotations

from tests._dist import run_distributed
from tests.dist import _ring_ops as R
from tests.dist import _ring_parity as RP

_runs: dict[int, object] = {}


def worker(rank: int, world_size: int) -> dict:
    names = tuple(c.name for c in R.CASES if world_size in c.worlds)
    out = {
        "ops": R.ops_worker(rank, world_size, names),
        "parity": RP.parity_worker(rank, world_size, RP.COMBOS[world_size]),
    }
    if world_size == 2:
        out["features"] = RP.features_worker(rank, world_size)
    return out


def results(world_size: int) -> list[dict]:
    """Every rank's results of the shared spawn for `world_size` (2 or 4)."""
    if world_size not in _runs:
        try:
            _runs[world_size] = run_distributed(worker, world_size, timeout=600)
        except Exception as exc:  # noqa: BLE001 - re-raised by every dependent test
            _runs[world_size] = exc
    if isinstance(_runs[world_size], Exception):
        raise _runs[world_size]
    return _runs[world_size]

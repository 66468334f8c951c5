"""Measurements of the SP path (`measure.py`) and loss-curve comparison of finished runs (`curves.py`)."""

from hf_longctx._lazy import lazy_exports

_EXPORTS = {
    name: "hf_longctx.instrument.measure"
    for name in (
        "CollectiveStat",
        "CollectiveStats",
        "PeakMemorySampler",
        "SPMetricsCallback",
        "active_recorder",
        "causal_lm_flops_per_token",
        "record_collectives",
        "timed_collective",
        "ulysses_min_bytes",
    )
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

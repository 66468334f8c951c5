"""Which memory flag to turn on next: `next_flag` re-estimates the run with each flag it does not use yet.

A candidate is kept only when `RunConfig` accepts it and, for the offload flags, when the host RAM it needs
fits `--host-memory` (the estimate counts offloaded activations and model states against it), so an
offload the host cannot hold is never advised. `hf-longctx plan` prints the answer (`cli/plan.py`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hf_longctx.planner.devices import DeviceProfile
from hf_longctx.planner.estimate import estimate, max_seq_len
from hf_longctx.planner.model_shape import ModelShape
from hf_longctx.planner.run import RunConfig
from hf_longctx.planner.terms import valid_head_chunks

# (flag as typed, the RunConfig fields it sets); offloading parameters under ZeRO-3 needs the optimizer too.
FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--gradient-checkpointing", {"gradient_checkpointing": True}),
    ("--tiled-loss", {"tiled_loss": True}),
    ("--tiled-mlp", {"tiled_mlp": True}),
    ("--tiled-layer", {"tiled_layer": True}),
    ("--offload-activations", {"offload_activations": True}),
    ("--liger-kernels", {"liger_kernels": True}),
    ("--offload-optimizer", {"offload_optimizer": True}),
    ("--offload-params", {"offload_params": True}),
    ("--offload-optimizer --offload-params", {"offload_optimizer": True, "offload_params": True}),
)


@dataclass(frozen=True)
class Advice:
    """The flag that lowers the peak most, the plan's peak and fit with it, and (with `--max-seq`) the
    longest sequence it allows."""

    flag: str
    peak_gib: float
    fits: bool
    host_gib: float
    max_seq: int | None = None


def candidates(model: ModelShape, run: RunConfig) -> list[tuple[str, RunConfig]]:
    """Every flag not yet on, applied alone to `run`, that `RunConfig` accepts (more head chunks count as one
    flag per valid count)."""
    fields = asdict(run)
    options = [(flag, change) for flag, change in FLAGS if any(fields[k] != v for k, v in change.items())]
    if run.sp > 1:
        more = [c for c in valid_head_chunks(model, run.sp) if c > run.ulysses_head_chunks]
        options += [(f"--ulysses-head-chunks {c}", {"ulysses_head_chunks": c}) for c in more]
    out = []
    for flag, change in options:
        try:
            out.append((flag, RunConfig(**{**fields, **change})))
        except ValueError:
            continue  # a flag this engine / kernel does not take
    return out


def next_flag(model: ModelShape, run: RunConfig, device: DeviceProfile, with_max_seq: bool = False) -> Advice | None:
    """The candidate flag with the lowest peak below the current one whose host RAM fits; None if none helps.

    Args:
        model, run, device: as for `estimate`.
        with_max_seq: also bisect the longest sequence with each candidate on (`max_seq_len`) and keep only
            those that lengthen it (under `--host-memory` a host-hungry flag can shorten it).

    Returns:
        An `Advice`, or None when no flag not yet on lowers the peak within the host RAM.
    """
    current = estimate(model, run, device).peak_gib
    longest_now = max_seq_len(model, run, device) if with_max_seq else 0
    best: Advice | None = None
    for flag, config in candidates(model, run):
        plan = estimate(model, config, device)
        host_fits = plan.host_capacity_gib is None or plan.host_gib <= plan.host_capacity_gib
        if not host_fits or plan.peak_gib >= current or (best is not None and plan.peak_gib >= best.peak_gib):
            continue
        longest = max_seq_len(model, config, device) if with_max_seq else None
        if longest is None or longest > longest_now:
            best = Advice(flag=flag, peak_gib=plan.peak_gib, fits=plan.fits, host_gib=plan.host_gib, max_seq=longest)
    return best

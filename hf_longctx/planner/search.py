"""The cheapest configuration that fits: `search(model, run, device)` re-plans a run over what is a setting.

Why: a plan that does not fit should end in the settings to use, not in a dead end. The search keeps what the
hardware and the data fix (sequence length, world, micro-batch, dtype, attention kernel, host RAM, router loss) and
varies the engine with its offloads (`ENGINE_OPTIONS`: DDP, ZeRO-3, FSDP2, each with a shipped launch config), the
SP size (a divisor of the world that splits the query heads and stays inside a node), `gradient_checkpointing` and
hf_longctx's memory flags. Each combination `RunConfig` accepts is planned, cheapest first by `cost`; the cheapest
that fits with the planner's error as headroom (`PLAN_ERROR`) wins, ties going to fewer changes from the run asked
for, then to the lower peak. Not varied: Liger kernels (no hf_longctx setting turns them on), ZeRO-1/2 (no shipped
launch config), tile counts (the automatic ones only); `tiled_layer` only for the model families it tiles.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from hf_longctx.planner.devices import DeviceProfile
from hf_longctx.planner.estimate import PLAN_ERROR, Plan, estimate
from hf_longctx.planner.model_shape import ModelShape
from hf_longctx.planner.run import RunConfig
from hf_longctx.planner.terms import valid_head_chunks

# Engines with their offloads, as the shipped launch configs run them (`settings.LAUNCH_CONFIGS`).
ENGINE_OPTIONS: tuple[dict[str, Any], ...] = (
    {"engine": "ddp"},
    {"engine": "zero3"},
    {"engine": "fsdp2"},
    {"engine": "zero3", "offload_optimizer": True},
    {"engine": "fsdp2", "offload_params": True},
    {"engine": "zero3", "offload_optimizer": True, "offload_params": True},
)
FLAGS = ("gradient_checkpointing", "tiled_loss", "tiled_mlp", "tiled_layer", "offload_activations")
# model_type values whose decoder layers `tiled_layer` tiles (memory/layer_match.py's reference families).
TILED_LAYER_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# What each setting adds to a step's work, as points: an order of preference, not a time model (nothing here is
# measured). Long-sequence steps are dominated by attention compute, so recomputing is dear and traffic that
# overlaps with compute is cheap; crossing PCIe every step is dearest.
COSTS: dict[str, int] = {
    "tiled_loss": 1,  # the LM head still runs once (its gradient is computed in forward): a loop over tiles
    "sp": 1,  # per doubling of SP: Ulysses all-to-alls of q, k, v and the output in every layer
    "sharded": 2,  # ZeRO-3 / FSDP2: parameters gathered in forward and again in backward, overlapped
    "tiled_mlp": 2,  # each MLP tile's forward once more in backward
    "tiled_layer": 2,  # beyond checkpointing: per-tile loops, K/V of the whole sequence recomputed per layer
    "head_chunks": 3,  # attention (the dominant cost at long sequences) recomputed per head chunk in backward
    "offload_activations": 3,  # every layer's input to the host and back (overlapped), pinned host RAM
    "checkpointing": 4,  # every layer's forward once more in backward (about a third more compute)
    "offload_optimizer": 5,  # AdamW on the CPU every step, gradients copied to the host
    "offload_params": 8,  # every parameter over PCIe in each forward and each backward
}


@dataclass(frozen=True)
class Suggestion:
    """A configuration the search planned: its run, plan, cost and changes from the run asked for."""

    run: RunConfig
    plan: Plan
    cost: int
    changes: int


@dataclass(frozen=True)
class SearchResult:
    """`best`: the cheapest configuration that fits (None if none does); `lowest`: the lowest peak planned;
    `planned` of the `candidates` were planned."""

    best: Suggestion | None
    lowest: Suggestion | None
    planned: int
    candidates: int


def cost(run: RunConfig) -> int:
    """The run's points (`COSTS`): what its engine, offloads, SP size and memory flags add to a step."""
    points = COSTS["sp"] * (run.sp - 1).bit_length()
    points += COSTS["sharded"] if run.engine in ("zero3", "fsdp2") else 0
    points += COSTS["checkpointing"] if run.checkpointing else 0
    points += COSTS["head_chunks"] if run.ulysses_head_chunks > 1 else 0
    for key in ("tiled_loss", "tiled_mlp", "tiled_layer", "offload_activations", "offload_optimizer"):
        points += COSTS[key] if getattr(run, key) is not False else 0
    return points + (COSTS["offload_params"] if run.offload_params else 0)


def sp_sizes(model: ModelShape, run: RunConfig) -> list[int]:
    """SP sizes to try: divisors of the world that divide the query heads, each group inside one node (Ulysses over
    NVLink): not the run's own size when its groups span nodes (the plan warns; hybrid SP is not modelled)."""
    one_node = run.world <= run.node_ranks  # else a group must divide the node's ranks (`RunConfig.sp_spans_nodes`)
    sizes = range(1, run.node_ranks + 1)
    return [p for p in sizes if run.world % p == 0 and model.heads % p == 0 and (one_node or run.node_ranks % p == 0)]


def candidates(model: ModelShape, run: RunConfig) -> Iterator[RunConfig]:
    """Every configuration the search plans: `run` with another engine, SP size, head chunks and memory flags."""
    base = {**asdict(run), "liger_kernels": False, "offload_optimizer": False, "offload_params": False}
    tiles_layers = model.model_type in TILED_LAYER_TYPES
    for engine, sp in itertools.product(ENGINE_OPTIONS, sp_sizes(model, run)):
        switches = itertools.product((False, True), repeat=len(FLAGS))
        for chunks, flags in itertools.product(valid_head_chunks(model, sp), switches):
            on = dict(zip(FLAGS, flags, strict=True))
            if (on["tiled_layer"] and (not tiles_layers or chunks > 1)) or (on["tiled_mlp"] and model.experts):
                continue  # not tiled by hf_longctx, or head chunks that do not apply inside a tiled layer
            try:
                yield RunConfig(**{**base, **engine, **on, "sp": sp, "ulysses_head_chunks": chunks})
            except ValueError:
                continue  # a combination RunConfig refuses (e.g. --tiled-layer with eager attention)


def changes(run: RunConfig, asked: RunConfig) -> int:
    """How many fields differ from the run asked for."""
    theirs = asdict(asked)
    return sum(value != theirs[key] for key, value in asdict(run).items())


def search(model: ModelShape, run: RunConfig, device: DeviceProfile, margin: float = PLAN_ERROR) -> SearchResult:
    """The cheapest configuration of `run` that fits `device` with `margin` headroom, and the lowest peak planned.

    Plans candidates in order of (cost, changes from `run`) and stops after the first cost tier with a fit; without
    a fit it plans them all, so `lowest` tells how far the best one is from fitting.
    """
    ranked = sorted(((cost(c), changes(c, run), c) for c in candidates(model, run)), key=lambda t: t[:2])
    best: Suggestion | None = None
    lowest: Suggestion | None = None
    planned = 0
    for points, changed, config in ranked:
        if best is not None and (points, changed) > (best.cost, best.changes):
            break
        planned += 1
        found = Suggestion(config, estimate(model, config, device), points, changed)
        if lowest is None or found.plan.peak_gib < lowest.plan.peak_gib:
            lowest = found
        if found.plan.fits_within(margin) and (best is None or found.plan.peak_gib < best.plan.peak_gib):
            best = found
    return SearchResult(best, lowest, planned, len(ranked))

"""The RoPE a model needs to train on rows of `max_length` tokens, from its own config: `plan_rope` is the main one.

A RoPE scaling is written for one model: YaRN's `original_max_position_embeddings` must be the positions the model
was pretrained on, and `factor` x those positions must reach `max_length`. A recipe's scaling carried over to
another model (Llama 3's 8,192 native positions onto Qwen3's 32,768) trains silently wrong, so `plan_rope` checks a
given scaling against the model and derives one on request (`"auto"`). Pure: it reads a transformers config (or a
`config.json` dict) and imports nothing, so a custom training script can call it before building the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Configs whose `max_position_embeddings` is not what they were pretrained on, keyed by (model_type, that number).
# The first Qwen3 release writes 40,960 (32,768 for the output plus 8,192 for the prompt) but "natively supports
# context lengths of up to 32,768 tokens" and configures YaRN over 32,768 (https://huggingface.co/Qwen/Qwen3-8B,
# "Processing Long Texts"). Qwen3-2507's 262,144 are native and are not listed.
_NATIVE_BY_RELEASE = {("qwen3", 40960): 32768, ("qwen3_moe", 40960): 32768}
# RoPE types `"auto"` extends with YaRN; others (longrope, dynamic NTK, mRoPE sections) need a hand-written scaling.
_EXTENDABLE = {"default", "linear", "llama3", "yarn"}


@dataclass(frozen=True)
class RopePlan:
    """What to set on the model's (text) config: `rope_parameters` and `max_position_embeddings`; None keeps it."""

    rope_parameters: dict[str, Any] | None
    max_position_embeddings: int | None
    native_positions: int
    note: str  # what was chosen and why

    def describe(self) -> str:
        """One line for the training log: the RoPE set (or kept) and why."""
        if self.rope_parameters is None:
            return f"RoPE: {self.note}"
        rope = json.dumps(self.rope_parameters, sort_keys=True)
        return f"RoPE: {rope}, {self.max_position_embeddings:,} positions ({self.note})"

    def overrides(self) -> dict[str, Any]:
        """The config fields to set ({} when the model's RoPE is kept)."""
        if self.rope_parameters is None:
            return {}
        return {"rope_parameters": self.rope_parameters, "max_position_embeddings": self.max_position_embeddings}


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def model_rope(config: Any) -> dict[str, Any]:
    """The model's RoPE as transformers 5 names it (`rope_parameters`, with `rope_type` and `rope_theta`).

    transformers 5 configs carry `rope_parameters`; older `config.json` files carry `rope_scaling` (its type under
    `rope_type` or `type`) beside a top-level `rope_theta`, folded in here.
    """
    rope = dict(_get(config, "rope_parameters") or _get(config, "rope_scaling") or {})
    if rope and all(isinstance(value, dict) for value in rope.values()):  # one RoPE per layer type (Gemma 3)
        return {"rope_type": "per layer type", **rope}
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    rope.setdefault("rope_type", "default")
    if _get(config, "rope_theta") is not None:
        rope.setdefault("rope_theta", _get(config, "rope_theta"))
    return rope


def native_positions(config: Any) -> int:
    """The positions the model was pretrained on: what a RoPE scaling of it must name as its original length."""
    rope = model_rope(config)
    if rope["rope_type"] != "default" and rope.get("original_max_position_embeddings"):
        return int(rope["original_max_position_embeddings"])
    if _get(config, "original_max_position_embeddings"):  # Phi-3 keeps it at the top level
        return int(_get(config, "original_max_position_embeddings"))
    positions = int(_get(config, "max_position_embeddings"))
    return _NATIVE_BY_RELEASE.get((_get(config, "model_type"), positions), positions)


def _derived(rope: dict[str, Any], native: int, max_length: int) -> dict[str, Any]:
    """YaRN over the model's native positions with `factor = max_length / native`, keeping its base and band."""
    if rope["rope_type"] not in _EXTENDABLE or "mrope_section" in rope or "rope_theta" not in rope:
        raise ValueError(
            f"rope_parameters: auto extends {sorted(_EXTENDABLE)} RoPE; this model's is {rope['rope_type']!r} "
            f"({rope}): give rope_parameters (and max_position_embeddings) for it explicitly."
        )
    out = {"rope_type": "yarn", "factor": max_length / native, "original_max_position_embeddings": native}
    out["rope_theta"] = rope["rope_theta"]
    if rope["rope_type"] == "llama3":  # YaRN's interpolation band at Llama 3's own (UltraLong-8B, arXiv 2504.06214)
        out.update(beta_fast=float(rope["high_freq_factor"]), beta_slow=float(rope["low_freq_factor"]))
    kept = ("partial_rotary_factor", *(("beta_fast", "beta_slow") if rope["rope_type"] == "yarn" else ()))
    out.update({key: rope[key] for key in kept if key in rope})
    return out


def plan_rope(
    config: Any,
    max_length: int,
    rope_parameters: dict[str, Any] | str | None = None,
    max_position_embeddings: int | None = None,
) -> RopePlan:
    """Check or derive the RoPE for rows of `max_length` tokens on the model `config` describes.

    Args:
        config: the model's (text) config, or its `config.json` as a dict.
        max_length: the longest row (a document of a packed row counts on its own) training will run.
        rope_parameters: None keeps the model's RoPE unchecked (packed short documents need no more positions);
            `"auto"` keeps it when the model reaches `max_length`, else derives YaRN over its native positions;
            a mapping (transformers' `rope_parameters`) replaces the model's, `rope_theta` defaulting to its own,
            after checking that it names the model's native positions and reaches `max_length`.
        max_position_embeddings: with a mapping, the positions to set (default: `factor` x its original positions).

    Returns:
        The `RopePlan`; `plan.overrides()` are the config fields to set.

    Raises:
        ValueError: a given scaling written for other native positions, or one that does not reach `max_length`,
            or `"auto"` for a RoPE type it cannot extend. Each message names the fix.
    """
    rope, native = model_rope(config), native_positions(config)
    reach = int(_get(config, "max_position_embeddings"))
    name = _get(config, "model_type") or "the model"
    if rope_parameters is None:
        return RopePlan(None, None, native, f"the model's own ({rope['rope_type']}, {reach:,} positions)")
    if rope_parameters == "auto":
        if max_length <= reach:
            note = f"the model's own: its {reach:,} positions ({rope['rope_type']}) reach max_length {max_length:,}"
            return RopePlan(None, None, native, note)
        derived = _derived(rope, native, max_length)
        note = f"derived: YaRN factor {derived['factor']:g} over {name}'s {native:,} native positions"
        return RopePlan(derived, max_length, native, note)
    if isinstance(rope_parameters, str):
        raise ValueError(f"rope_parameters must be a mapping or 'auto', not {rope_parameters!r}.")
    given = dict(rope_parameters)
    if "rope_theta" in rope:
        given.setdefault("rope_theta", rope["rope_theta"])
    original = given.get("original_max_position_embeddings")
    fix = f"rope_parameters: auto (YaRN factor {max_length / native:g} over {native:,} for {max_length:,} tokens)"
    if original is not None and int(original) != native:
        raise ValueError(
            f"rope_parameters names original_max_position_embeddings {int(original):,}, but {name} was pretrained on "
            f"{native:,} positions: the scaling was written for another model. Set {fix}, or give "
            f"original_max_position_embeddings: {native} with factor >= {max_length / native:g}."
        )
    positions = max_position_embeddings
    if positions is None and original is not None and given.get("factor") is not None:
        positions = int(float(given["factor"]) * int(original))
    positions = positions or reach
    if positions < max_length:
        raise ValueError(
            f"rope_parameters reaches {positions:,} positions, fewer than max_length {max_length:,}: set {fix}, "
            "or raise its factor (and max_position_embeddings)."
        )
    return RopePlan(given, positions, native, f"as given, checked against {name}'s {native:,} native positions")

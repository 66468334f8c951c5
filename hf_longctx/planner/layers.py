"""The decoder layers of one rank by attention kind, as a step keeps them: `layer_stack`, for `planner.estimate`.

A model may mix full, sliding-window and chunked attention layers (Gemma 2/3, gpt-oss, Llama 4; `ModelShape.
layer_types`); each kind has its own terms (`terms.layer_bytes`). `tiled_layer` tiles the full-attention layers
only (`memory/layer_match.py` leaves windowed and chunked ones untiled), so those keep their untiled terms and are
checkpointed only by `gradient_checkpointing` or `offload_activations`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from hf_longctx.planner.model_shape import ModelShape
from hf_longctx.planner.terms import LayerBytes, layer_bytes
from hf_longctx.planner.tiled import tiled_layer_bytes

if TYPE_CHECKING:
    from hf_longctx.planner.run import RunConfig


@dataclass(frozen=True)
class LayerKind:
    """`count` layers of attention `kind`: their bytes each, whether they are tiled and checkpointed."""

    kind: str
    count: int
    bytes: LayerBytes
    tiled: bool
    checkpointed: bool

    def kept(self, checkpoint: float) -> float:
        """What one such layer keeps until its backward: its input when checkpointed, else its saved tensors."""
        return checkpoint if self.checkpointed else self.bytes.saved


@dataclass(frozen=True)
class LayerStack:
    """Every kind of decoder layer of the model (`kinds`, the first layer's kind first)."""

    kinds: tuple[LayerKind, ...]

    def largest(self, field: str) -> float:
        """The largest per-layer term `field` of `LayerBytes` over the kinds (transients: one layer at a time)."""
        return max(getattr(k.bytes, field) for k in self.kinds)

    def recompute(self) -> float:
        """The saved tensors of the largest checkpointed layer, rebuilt in backward (0 without checkpointing)."""
        return max((k.bytes.saved for k in self.kinds if k.checkpointed), default=0.0)

    def stored(self, checkpoint: float) -> float:
        """What all layers keep until their backward."""
        return sum(k.count * k.kept(checkpoint) for k in self.kinds)


def layer_stack(model: ModelShape, run: RunConfig, tokens: int, on_cpu: bool) -> LayerStack:
    """The model's layers on one rank by kind, in order of their first layer."""
    untiled = replace(run, tiled_layer=False)
    kinds = []
    for kind, count in model.layer_kinds().items():
        tiled = run.tiled_layer is not False and kind == "full_attention"
        if tiled:
            terms = tiled_layer_bytes(model, run, tokens, on_cpu)
        else:
            terms = layer_bytes(model, untiled, tokens, on_cpu, kind)
        checkpointed = run.checkpointing if tiled else untiled.checkpointing
        kinds.append(LayerKind(kind, count, terms, tiled, checkpointed))
    return LayerStack(tuple(kinds))

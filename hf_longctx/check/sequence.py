"""What `hf-longctx check` adds for the computations a model makes over the whole sequence outside attention.

The check compares the whole loss the model trains on: the token loss plus its MoE router loss, with the router
loss switched on (`output_router_logits`); it runs RoPE whose frequencies change at run time (dynamic NTK,
longrope) past the native length the shrunk copy is given, and Llama 4's attention temperature with a floor scale
the rows cross, so the rescaled frequencies and query scales are exercised, also in every packed document.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hf_longctx.sequence.router_source import FLAG, router_loss_source


def switch_on_sequence_ops(text: Any, seq_len: int) -> list[str]:
    """Turn on the router loss and let the rows, and each of the three documents of a packed row, cross a run-time
    RoPE's native length and the attention temperature's floor scale in the (shrunk) text config."""
    notes = []
    if hasattr(text, FLAG) and not getattr(text, FLAG):
        setattr(text, FLAG, True)
        notes.append(f"{FLAG} False -> True (the router loss is part of the compared loss)")
    floor = max(2, seq_len // 16)
    if getattr(text, "attn_temperature_tuning", False) and getattr(text, "floor_scale", 0) > floor:
        notes.append(f"attention temperature: floor_scale {text.floor_scale} -> {floor} (the rows cross it)")
        text.floor_scale = floor
    params = getattr(text, "rope_parameters", None) or {}
    variants = params.values() if params and all(isinstance(v, Mapping) for v in params.values()) else [params]
    native = max(4, seq_len // 4)  # below a third of the row: each packed document crosses it too
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for rope in variants:
        kind = rope.get("rope_type", "") if isinstance(rope, Mapping) else ""
        if "dynamic" in kind and text.max_position_embeddings > native:
            notes.append(
                f"dynamic RoPE: native positions {text.max_position_embeddings} -> {native} (the rows cross it)"
            )
            text.max_position_embeddings = native
        if kind == "longrope":
            notes.append(f"longrope: original positions {rope.get('original_max_position_embeddings')} -> {native}")
            rope["original_max_position_embeddings"] = native
            if getattr(text, "original_max_position_embeddings", None) is not None:
                text.original_max_position_embeddings = native  # Phi-3 reads its own field back over rope_parameters
            width = int(head_dim * rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))) // 2
            for key in ("short_factor", "long_factor"):
                factors = rope.get(key)
                if isinstance(factors, list) and len(factors) != width:
                    rope[key] = (factors * (width // max(len(factors), 1) + 1))[:width]
                    notes.append(f"longrope {key}: {len(factors)} -> {width} values (head_dim {head_dim})")
    return notes


def router_term(model: torch.nn.Module, output: Any) -> torch.Tensor | float:
    """`coefficient x aux_loss` of a forward (0.0 when the model adds no router loss): with the token loss, the
    loss the model trains on."""
    source = router_loss_source(type(model))
    aux = getattr(output, "aux_loss", None)
    if source is None or source.refusal is not None or aux is None:
        return 0.0
    return source.settings(model)[1] * aux


def reference_router_term(model: torch.nn.Module, outputs: Sequence[Any]) -> torch.Tensor | float:
    """The router term of a row run as several per-document forwards: transformers' own function on every
    document's router logits together (the loss pools all tokens of the batch)."""
    if len(outputs) == 1:
        return router_term(model, outputs[0])
    source = router_loss_source(type(model))
    if source is None or source.refusal is not None or outputs[0].router_logits is None:
        return 0.0
    top_k, coefficient = source.settings(model)
    gate = tuple(torch.cat(layer, dim=0) for layer in zip(*(o.router_logits for o in outputs), strict=True))
    function = sys.modules[type(model).__module__].load_balancing_loss_func
    return coefficient * function(gate, gate[0].shape[-1], top_k, None)

"""Which decoder layers `tiled_layer` can run tile by tile exactly: `untiled_reason(layer)`.

`tiled_layer` reimplements the Llama-family residual block and attention forward over sequence tiles, so a
layer qualifies only when its class's forward is transformers' own (compared by bytecode fingerprint with
the Llama / Qwen2 / Qwen3 / Mistral classes) and nothing in it mixes tokens outside attention.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.memory.tiled_mlp import _is_moe, _mixes_tokens

LAYER_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
HEAD_NORMS = ("q_norm", "k_norm")
_REFERENCE_MODULES = ("llama", "qwen2", "qwen3", "mistral")


def _fingerprint(function: Callable[..., Any]) -> tuple[bytes, tuple[str, ...]]:
    code = inspect.unwrap(function).__code__
    return code.co_code, code.co_names


@functools.cache
def _reference_forwards() -> tuple[frozenset, frozenset]:
    """Fingerprints of the decoder-layer and attention forwards this module reimplements (transformers' own)."""
    import importlib

    layers, attentions = set(), set()
    for name in _REFERENCE_MODULES:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[name]
        layers.add(_fingerprint(getattr(module, f"{prefix}DecoderLayer").forward))
        attentions.add(_fingerprint(getattr(module, f"{prefix}Attention").forward))
    return frozenset(layers), frozenset(attentions)


def weight_shape(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(weight, "ds_shape", weight.shape))  # ZeRO-3 partitions weights in place


def untiled_reason(layer: torch.nn.Module) -> str | None:
    """Why `layer` cannot be tiled exactly, or None when it can (Llama / Qwen2 / Qwen3 / Mistral structure)."""
    children = {name for name, _ in layer.named_children()}
    if children != LAYER_CHILDREN:
        return f"its children {sorted(children)} are not {sorted(LAYER_CHILDREN)}"
    attn, mlp = layer.self_attn, layer.mlp
    layer_forwards, attention_forwards = _reference_forwards()
    if _fingerprint(type(layer).forward) not in layer_forwards:
        return "its forward is not the Llama-family residual block"
    if _fingerprint(type(attn).forward) not in attention_forwards:
        return f"{type(attn).__name__}.forward is not a Llama / Qwen2 / Qwen3 / Mistral attention"
    attn_children = {name for name, _ in attn.named_children()}
    if not ATTENTION_CHILDREN <= attn_children or attn_children - ATTENTION_CHILDREN - set(HEAD_NORMS):
        return f"its attention's children {sorted(attn_children)} are not q/k/v/o_proj (+ q_norm, k_norm)"
    for name in HEAD_NORMS:
        norm = getattr(attn, name, None)
        if norm is not None and weight_shape(norm.weight)[-1] != attn.head_dim:
            return f"{name} normalises the whole projection, not each head"
    if _is_moe(mlp) or _mixes_tokens(mlp):
        return "its MLP is a mixture of experts or mixes tokens"
    config = attn.config
    window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
    types = getattr(config, "layer_types", None)
    if window is not None or (types is not None and types[attn.layer_idx] != "full_attention"):
        return "it has a sliding window or chunked attention"
    if getattr(config, "attn_logit_softcapping", None) or hasattr(attn, "sinks"):
        return "its attention has soft-capping or sinks"
    if getattr(attn, "attention_dropout", 0.0):
        return "its attention has dropout"
    if not hasattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb"):
        return "its module has no apply_rotary_pos_emb"
    return None

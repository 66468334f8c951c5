"""Attention hf_longctx does not compute, refused by name before any step: `check_attention_semantics`.

hf_longctx's attention is causal within each document of `position_ids`, with the sliding window or chunk size a
layer passes to transformers' attention interface. What a model adds only when transformers *creates its mask*
never reaches it (hf_longctx builds no mask): bidirectional or prefix-LM text attention (`use_bidirectional_attention`,
`prefix_lm`, an attention module with `is_causal = False`), and layer types whose attention reads more than the
layer's keys (DeepSeek-V3.2's `indexed_attention` indexer, DeepSeek-V4's compressed KV). Served silently, each
would be a wrong loss; a model whose decoder never calls the attention interface would run with no mask at all.
"""

from __future__ import annotations

import sys

import torch

from hf_longctx.attention.linear.support import _decoder, _text_config

# `layer_types` entries hf_longctx's attention computes exactly (the window / chunk comes with the call).
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
NON_CAUSAL_FLAGS = ("use_bidirectional_attention", "prefix_lm")


def attention_semantics_refusal(model: torch.nn.Module) -> str | None:
    """What in `model`'s text attention hf_longctx would compute differently (None: nothing)."""
    config = _text_config(model)
    for flag in NON_CAUSAL_FLAGS:
        if getattr(config, flag, False):
            return f"its config sets {flag}={getattr(config, flag)!r} (attention that is not causal)"
    for kind in getattr(config, "layer_types", None) or []:
        # "sparse" names indexer layers too (MiniMax-M3's "minimax_m3_sparse": a top-k of the keys).
        if (
            isinstance(kind, str)
            and (kind.endswith("attention") or "sparse" in kind)
            and kind not in SERVED_LAYER_TYPES
        ):
            if "linear" not in kind:  # linear attention: `check_token_mixers` decides
                return f"a layer of type {kind!r} (hf_longctx serves {', '.join(SERVED_LAYER_TYPES)})"
    for name, module in _decoder(model).named_modules():
        if getattr(module, "is_causal", None) is False:
            return f"{name} ({type(module).__name__}) has is_causal=False"
    return None


def check_attention_semantics(model: torch.nn.Module) -> None:
    """Raise a ValueError naming what hf_longctx's causal document attention cannot compute in `model`."""
    why = attention_semantics_refusal(model)
    if why is not None:
        raise ValueError(
            f"{type(model).__name__}: {why}. hf_longctx's attention is causal within documents and builds no mask, "
            "so that attention would be computed differently and the loss would be wrong. Train it without "
            "hf_longctx's attention (no sp_size > 1)."
        )


def uses_attention_interface(model: torch.nn.Module) -> bool:
    """Whether the text decoder's modeling module calls transformers' attention interface (`ALL_ATTENTION_FUNCTIONS`);
    older ones (Bloom, MPT, GPT-Neo, XGLM, ...) compute attention themselves from the mask transformers builds."""
    module = sys.modules.get(type(_decoder(model)).__module__)
    return module is not None and hasattr(module, "ALL_ATTENTION_FUNCTIONS")

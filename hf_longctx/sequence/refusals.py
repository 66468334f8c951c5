"""What couples a shard to the rest of the sequence outside attention and cannot be made exact: refused by name.

Found by an audit of transformers 5.25's decoders and PEFT 0.21, re-checked against PEFT 0.22 (docs/sequence-ops.md
lists every computation with its state). Each entry would see only this rank's shard under SP and give a wrong loss
without any error:

- Doge: its router reinterprets `[batch, seq, 2K]` scores as `[2, batch * seq, K]` (the scores of one token pair with
  another's, `modeling_doge.py` `DogeCDMoE`), and its attention keeps a top-k of the keys it is given;
- BLT: its byte n-gram hash embeddings read the previous bytes of every token;
- PEFT prompt learning (prompt tuning, P-tuning, multitask prompt tuning, CPT, prefix tuning, Cartridge): virtual tokens
  or a key/value prefix are added to whatever the PEFT model is given, every shard its own copy, and its position ids
  are dropped (`PeftModel._adjust_prompt_learning_kwargs`);
- PEFT Lily: the adapter's expert weights are a mean of router probabilities over all tokens of the batch;
- PEFT activated LoRA (aLoRA): the adapter applies to the tokens after the invocation sequence, found by searching the
  `input_ids` the model is given and counted from the end of that row;
- PEFT ShadowPEFT: a shadow network with its own attention beside the model, and an auxiliary loss that shifts the
  (already shifted) labels again;
- PEFT X-LoRA: a scaling pass of the whole model inside a forward pre-hook before the real pass.

AdaLoRA's regulariser is made exact instead (`adapter_terms.py`); LLaMA-Adapter (adaption prompt) is exact as is
(its prompt attention reads each query token alone).
"""

from __future__ import annotations

from typing import Any

import torch

MODEL_TYPES = {
    "doge": "its router pairs the scores of different tokens and its attention keeps a top-k of the keys it is given",
    "blt": "its byte n-gram hash embeddings read the bytes before each token",
}
PEFT_TYPES = {
    "LILY": "its adapter weights average router probabilities over every token of the batch",
    # PEFT 0.22 `ShadowModel`: measured at SP=2, loss +4.6% and gradients 117% off.
    "SHADOW": (
        "its shadow network runs its own attention (not through transformers' attention interface) on the "
        "tokens it is given, and its auxiliary loss shifts the labels it is given a second time"
    ),
    "XLORA": (
        "its forward runs the model twice from a forward pre-hook (a scaling pass, then the pass with the scalings "
        "it computed), which hf_longctx has not made exact"
    ),
}


def _peft_refusal(model: Any) -> str | None:
    for name, config in (getattr(model, "peft_config", None) or {}).items():
        kind = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", "")))
        if getattr(config, "is_prompt_learning", False):
            return (
                f"its PEFT adapter {name!r} ({kind}) adds virtual tokens or a key/value prefix to each shard and "
                "drops the position ids"
            )
        if kind in PEFT_TYPES:
            return f"its PEFT adapter {name!r} ({kind}): {PEFT_TYPES[kind]}"
        if getattr(config, "alora_invocation_tokens", None) is not None:
            return (
                f"its PEFT adapter {name!r} is an activated LoRA (alora_invocation_tokens): it finds the invocation "
                "tokens in the row it is given"
            )
    return None


def sequence_refusal(model: torch.nn.Module) -> str | None:
    """Why `model` computes something over the whole sequence that SP cannot reproduce (None: nothing known)."""
    why = _peft_refusal(model)
    if why is not None:
        return why
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for kind in {getattr(config, "model_type", None), getattr(text, "model_type", None)}:
        if kind in MODEL_TYPES:
            return MODEL_TYPES[kind]
    return None


def check_sequence_ops(model: torch.nn.Module, sp_size: int) -> None:
    """Raise a ValueError naming what in `model` SP would compute on a shard only (nothing with one rank).

    Raises:
        ValueError: see the module docstring.
    """
    why = sequence_refusal(model) if sp_size > 1 else None
    if why is not None:
        raise ValueError(
            f"{type(model).__name__}: {why}. Under sequence parallelism each rank would compute it on its own shard "
            "and the loss would be wrong; train this model with sp_size=1."
        )

"""Tiny random-init MoE decoders of every transformers family whose forward adds a router load-balancing loss.

`router_loss_families()` finds them programmatically (every `AutoModelForCausalLM` class whose forward calls
`load_balancing_loss_func`, read by `hf_longctx.sequence.router_source`); `tiny_moe(model_type)` builds one with the
router loss on and a non-zero coefficient, 4 experts, top-2, 2 layers, hidden 64, float32. A few families need a
config this generic recipe cannot give (`UNBUILT`, each with the reason); a test checks that the two lists cover
every family found, so a new family shows up as untested rather than silently.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

# Hybrid decoders whose other token mixers hf_longctx refuses at every SP size (Mamba, lightning attention, a Gated
# DeltaNet with its own projection layout): no hf_longctx run exists to compare against.
REFUSED_MIXERS = ("jamba", "granitemoehybrid", "minimax", "lara_mini")
UNBUILT = {
    "dbrx": "its attention settings live in a nested attn_config the generic recipe does not fill",
    "deepseek_v4": "compressed-KV attention needs a hand-made config (and is refused under SP by layer type)",
    "doge": "its router loss differs from transformers' shared one: refused under SP (router_source)",
    "flint": "needs a hand-made config",
    "qwen4_exp": "its sparse-attention indexer needs a hand-made config",
    "qwen4_exp_text": "its sparse-attention indexer needs a hand-made config",
}
# The text configs of families whose AutoModelForCausalLM entry is a vision-language wrapper.
TEXT_TYPES = {"qwen3_5_moe": "qwen3_5_moe_text"}
_BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "use_cache": False,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.3,
    "aux_loss_coef": 0.3,  # JetMoe's name for it
    "attn_implementation": "sdpa",
}
_EXPERTS = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "top_k": 2,
    "router_jitter_noise": 0.0,  # noise draws random numbers: SP and the reference would differ
    "input_jitter_noise": 0.0,
}
_GATED_DELTANET = {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # fmt: skip
_EXTRA = {"qwen3_next": _GATED_DELTANET, "qwen3_5_moe_text": _GATED_DELTANET}


@functools.cache
def router_loss_families() -> tuple[str, ...]:
    """Model types whose `AutoModelForCausalLM` class adds a router load-balancing loss in its forward."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hf_longctx.sequence.router_source import router_loss_source

    found = []
    for model_type, name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        cls = getattr(transformers, name, None)
        if cls is not None and router_loss_source(cls) is not None:
            found.append(model_type)
    return tuple(found)


def tiny_moe_config(model_type: str, **overrides: Any) -> Any:
    """The tiny config `tiny_moe` builds (router loss on, coefficient 0.3)."""
    from transformers import AutoConfig

    model_type = TEXT_TYPES.get(model_type, model_type)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(model_type, **_BASE, **_EXTRA.get(model_type, {}))
    for key, value in {**_EXPERTS, **overrides}.items():
        if hasattr(config, key) or key in overrides:
            setattr(config, key, value)
    if getattr(config, "layer_types", None) is not None and len(config.layer_types) != config.num_hidden_layers:
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    return config


def tiny_moe(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A float32 causal LM of `model_type` in train mode, identical for equal seeds."""
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config(model_type, **overrides)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = AutoModelForCausalLM.from_config(config).float()
        except ValueError:  # no sdpa in this family (gpt-oss: sinks): its eager kernel
            config._attn_implementation = "eager"
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    model.train()
    return model

"""Tiny random-init float32 causal LMs built in-process, no hub download.

llama, qwen3 and mistral are the main shapes; gpt_oss (attention sinks, MoE, eager only),
deepseek_v3 (MLA: value head dim differs from query/key) and gemma2 (logit soft-capping and
alternating sliding windows, eager only) and llama4 (chunked attention layers) cover kernels that
read more than q, k and v, or layers whose mask comes from their layer type.

`tiny_model` is the one factory: it seeds before building, so every rank of a distributed test (and
the SP=1 reference in the same test) gets identical weights.
"""

from __future__ import annotations

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS: dict[str, tuple[type[PreTrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM),
    "llama4": (Llama4TextConfig, Llama4ForCausalLM),
}


def _arch_extras(arch: str, hidden: int, num_heads: int) -> dict:
    head_dim = hidden // num_heads
    if arch == "gpt_oss":
        # top-2 of 4: with top-1 the normalised routing weight is 1 and the router gets no gradient
        return {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}
    if arch == "deepseek_v3":
        # MLA: q/k head dim = nope + rope = 3/2 x head_dim, v head dim = head_dim (three all-to-alls).
        rope = head_dim // 2
        return {
            "q_lora_rank": None,
            "kv_lora_rank": 2 * head_dim,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": head_dim,
            "v_head_dim": head_dim,
            "head_dim": rope,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": hidden,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        }
    if arch == "llama4":
        # a chunked layer (chunks of 8 positions) and a full one; MoE with 2 experts
        return {
            "layer_types": ["chunked_attention", "full_attention"],
            "attention_chunk_size": 8,
            "num_local_experts": 2,
            "intermediate_size_mlp": 2 * hidden,
        }
    if arch == "gemma2":
        return {"sliding_window": 8, "attn_logit_softcapping": 50.0, "query_pre_attn_scalar": head_dim}
    return {}


def tiny_config(
    arch: str,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 128,
    attn: str = "sdpa",
) -> PreTrainedConfig:
    """The config `tiny_model` builds from (same arguments, no weights).

    Raises:
        ValueError: unknown `arch`, or `hidden` not divisible by `num_heads`, or `num_heads` not
            divisible by `num_kv_heads`.
    """
    if arch not in ARCHS:
        raise ValueError(f"tiny_config: unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    if hidden % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"tiny_config: need hidden % num_heads == 0 and num_heads % num_kv_heads == 0, got "
            f"hidden={hidden}, num_heads={num_heads}, num_kv_heads={num_kv_heads}"
        )
    config_cls, _ = ARCHS[arch]
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden // num_heads,
        max_position_embeddings=4096,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=attn,
    )
    if arch == "mistral":
        common["sliding_window"] = None
    common.update(_arch_extras(arch, hidden, num_heads))
    return config_cls(**common)


def tiny_model(
    arch: str,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 128,
    attn: str = "sdpa",
    seed: int = 0,
) -> PreTrainedModel:
    """A tiny random-init causal LM in float32 and train mode.

    Args:
        arch: a key of `ARCHS`.
        num_heads, num_kv_heads, hidden, layers, vocab: model shape; head_dim = hidden // num_heads,
            intermediate size = 2 * hidden.
        attn: `attn_implementation` ("sdpa", "eager", "flex_attention", or a registered key).
        seed: `torch.manual_seed` before building, so equal seeds give identical weights on every rank.

    Returns:
        The model (`LlamaForCausalLM`, ...), float32, `.train()`.

    Raises:
        ValueError: see `tiny_config`.
    """
    config = tiny_config(
        arch,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        hidden=hidden,
        layers=layers,
        vocab=vocab,
        attn=attn,
    )
    _, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config).float()
    model.train()
    return model

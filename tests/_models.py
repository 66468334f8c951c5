"""Tiny random-init float32 causal LMs (llama, qwen3, mistral) built in-process, no hub download.

`tiny_model` is the one factory: it seeds before building, so every rank of a distributed test (and
the SP=1 reference in the same test) gets identical weights.
"""

from __future__ import annotations

import torch
from transformers import (
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
}


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
        arch: "llama", "qwen3" or "mistral".
        num_heads, num_kv_heads, hidden, layers, vocab: model shape; head_dim = hidden // num_heads,
            intermediate size = 2 * hidden.
        attn: `attn_implementation` ("sdpa", "eager", "flex_attention", or a registered key).
        seed: `torch.manual_seed` before building, so equal seeds give identical weights on every rank.

    Returns:
        The model (`LlamaForCausalLM`, `Qwen3ForCausalLM` or `MistralForCausalLM`), float32, `.train()`.

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

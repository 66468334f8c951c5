"""Tiny models whose forward reads the whole sequence outside attention (for tests/dist/test_sequence_ops.py).

`sequence_model(kind)`: "dynamic" (Llama, dynamic-NTK RoPE, 32 native positions), "longrope" (Phi-3, 16 native
positions), "temperature" (Llama 4 text, attention temperature on its no-RoPE layer, floor_scale 4),
"position_scale" (Ministral 3, queries scaled by their position id), or
"moe:<model_type>" (`tests._moe_models.tiny_moe`: router loss on). Float32, train mode, identical for equal seeds.
"""

from __future__ import annotations

import warnings

import torch

from tests._moe_models import tiny_moe

_COMMON = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "use_cache": False,
           "pad_token_id": 0, "bos_token_id": None, "eos_token_id": None}  # fmt: skip


def _config(kind: str):
    from transformers import AutoConfig, Llama4TextConfig, LlamaConfig, Phi3Config

    if kind == "dynamic":
        rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
        return LlamaConfig(**_COMMON, max_position_embeddings=32, rope_parameters=rope)
    if kind == "longrope":
        rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.5] * 8,
                "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # fmt: skip
        # Phi3Config reads the native length from its own field (default 4096), not from rope_parameters.
        return Phi3Config(
            **_COMMON, max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters=rope
        )
    if kind == "temperature":
        # Layer 0 has no RoPE and the temperature (scale changes every 4 positions), layer 1 RoPE.
        return Llama4TextConfig(
            **_COMMON,
            intermediate_size_mlp=128,
            num_local_experts=2,
            no_rope_layers=[0, 1],
            attn_temperature_tuning=True,
            floor_scale=4,
            attn_scale=0.5,
            layer_types=["full_attention", "full_attention"],
            max_position_embeddings=512,
            # Llama 4's forward adds no router loss; with a coefficient TRL would add Mixtral's (refused under SP).
            router_aux_loss_coef=0.0,
        )
    if kind == "position_scale":
        # Ministral 3: queries scaled by 1 + beta log(1 + floor(position / 8)), from the position_ids given.
        rope = {"rope_type": "default", "rope_theta": 10000.0, "llama_4_scaling_beta": 0.5,
                "original_max_position_embeddings": 8}  # fmt: skip
        return AutoConfig.for_model("ministral3", **_COMMON, max_position_embeddings=512, rope_parameters=rope)
    raise ValueError(f"unknown kind {kind!r}")


def sequence_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """See the module docstring."""
    if kind.startswith("moe:"):
        return tiny_moe(kind.removeprefix("moe:"), seed=seed)
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = _config(kind)
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    model.train()
    return model

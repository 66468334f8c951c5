"""Run `hf-longctx check` on tiny configs of many transformers decoder architectures.

    python scripts/check_architectures.py                       # SP=2, packed rows, sdpa (eager where sdpa is missing)
    python scripts/check_architectures.py --sp 4 --attn eager llama gpt_oss deepseek_v3

Each architecture gets a small config built offline with `AutoConfig.for_model` (2 layers, hidden 64,
4 query / 2 key-value heads, vocab 256, a few experts for MoE models), written to a temporary folder and
checked in its own `hf-longctx check` process. The check switches each MoE family's router loss on and compares
the whole loss (token loss + router loss); Phi-3 and PhiMoE get the longrope RoPE their long-context checkpoints
ship with, which the check runs past its native length. Prints one line per architecture and a summary; exits 1 if
any check FAILed or crashed (INVALID, i.e. exit 2, is an expected refusal and is listed separately).
About 15 s per architecture at SP=2 on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

_GATED_DELTANET = {"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}  # fmt: skip
_SMALL_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32}  # fmt: skip

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    # default configs carry special-token ids of their full vocabulary
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
# The long-context Phi-3 / Phi-3.5-MoE checkpoints ship longrope (factors per rotary frequency: head_dim 16 -> 8).
_LONGROPE = {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.5] * 8,
                                 "original_max_position_embeddings": 4096, "rope_theta": 10000.0}}  # fmt: skip
EXTRA = {
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    # MLA with a value head dim different from the query/key head dim (nope + rope)
    "deepseek_v3": {
        "num_key_value_heads": 4,  # MLA: keys and values have one head per query head
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "head_dim": 8,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "llama4_text": {"attention_chunk_size": 16, "num_local_experts": 2, "intermediate_size_mlp": 128},
    "phi3": {**_LONGROPE, "max_position_embeddings": 131072},
    # PhiMoE's rotary also picks an mscale from the largest position (short 1.0, long 1.2 in Phi-3.5-MoE).
    "phimoe": {
        "rope_parameters": {**_LONGROPE["rope_parameters"], "short_mscale": 1.0, "long_mscale": 1.2},
        "max_position_embeddings": 131072,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "gemma2": {"sliding_window": 16},
    "gemma3_text": {"sliding_window": 16},
    "mistral": {"sliding_window": 16},
    "cohere2": {"sliding_window": 16},
    # Gated DeltaNet (head-parallel) + gated attention (+ MoE): 2 key / 4 value heads split at SP=2
    "qwen3_next": {**_GATED_DELTANET, **_SMALL_MOE},
    "qwen3_5_text": _GATED_DELTANET,
    "qwen3_5_moe_text": {**_GATED_DELTANET, **_SMALL_MOE},
    # token mixers outside attention: these must be refused (INVALID)
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "minimax": {"layer_types": ["full_attention", "linear_attention"], "num_local_experts": 2},
}
# vision-language models: the decoder config nested as text_config (the check shrinks the default vision tower);
# the check builds one document per row for them (mRoPE positions are per row)
_MROPE = {"mrope_section": [2, 3, 3]}
VISION_LANGUAGE = {
    "qwen2_vl": {"rope_scaling": {**_MROPE, "type": "mrope"}},
    "qwen2_5_vl": {"rope_scaling": {**_MROPE, "type": "mrope"}},
    "qwen3_vl": {"rope_scaling": {**_MROPE, "rope_type": "default", "mrope_interleaved": True}},
    "llava": {},
}
EAGER_ONLY = {"gemma2", "gpt_oss"}  # transformers offers no sdpa path for them
DEFAULT_TYPES = (
    "llama llama4_text mistral ministral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi phi3 "
    "olmo olmo2 olmo3 olmoe cohere cohere2 granite granitemoe glm glm4 glm4_moe starcoder2 stablelm gpt_oss "
    "deepseek_v3 smollm3 ernie4_5 helium exaone4 seed_oss arcee apertus hunyuan_v1_dense hunyuan_v1_moe nemotron "
    "jetmoe bitnet phimoe qwen3_next qwen3_5_text qwen3_5_moe_text qwen2_vl qwen2_5_vl qwen3_vl llava "
    # expected refusals (token mixing outside attention that hf_longctx has no adapter for)
    "lfm2 minimax falcon_h1 granitemoehybrid bamba jamba recurrent_gemma"
).split()


def write_config(model_type: str, folder: Path) -> None:
    from transformers import AutoConfig

    if model_type in VISION_LANGUAGE:
        config = AutoConfig.for_model(model_type, text_config={**BASE, **VISION_LANGUAGE[model_type]})
    else:
        config = AutoConfig.for_model(model_type, **{**BASE, **EXTRA.get(model_type, {})})
    config.save_pretrained(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", default=DEFAULT_TYPES)
    parser.add_argument("--sp", type=int, default=2)
    parser.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--no-packed", action="store_true", help="one document per row instead of 3 packed")
    args = parser.parse_args(argv)
    outcome: dict[str, list[str]] = {"PASS": [], "INVALID": [], "FAIL": []}
    with tempfile.TemporaryDirectory(prefix="hf_longctx_archs_") as tmp:
        for model_type in args.model_types:
            folder = Path(tmp) / model_type
            try:
                write_config(model_type, folder)
            except Exception as exc:  # an architecture this transformers version does not know
                print(f"{model_type:>18}: FAIL (config: {exc!r:.200})", flush=True)
                outcome["FAIL"].append(model_type)
                continue
            attn = "eager" if model_type in EAGER_ONLY else args.attn
            cmd = ["hf-longctx", "check", "--model", str(folder), "--sp", str(args.sp), "--attn", attn]
            cmd += [] if args.no_packed or model_type in VISION_LANGUAGE else ["--packed"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
            verdict = {0: "PASS", 2: "INVALID"}.get(proc.returncode, "FAIL")
            outcome[verdict].append(model_type)
            said = [ln for ln in lines if ln.startswith(("PASS", "FAIL", "INVALID"))] or lines or [""]
            print(f"{model_type:>18}: {verdict} ({attn}) {said[-1][:220]}", flush=True)
    print(" | ".join(f"{k} {len(v)}: {' '.join(v)}" for k, v in outcome.items()))
    return 1 if outcome["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())

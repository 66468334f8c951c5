"""`plan_rope` checks a recipe's RoPE scaling against the model it trains, or derives one from the model's config.

Tiny transformers 5 configs (LlamaConfig with Llama 3's `llama3` scaling, Qwen3Config as the first Qwen3 release
writes it, a config already carrying YaRN), older `config.json` dicts (`rope_scaling` beside `rope_theta`), and
every GPU recipe's RoPE against the shipped config of the model it names."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config, Qwen3Config

from hf_longctx.sequence.rope_extension import model_rope, native_positions, plan_rope

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "hf_longctx" / "data" / "model_configs"
HUB_NAMES = {"meta-llama/Llama-3.1-8B": "llama3.1-8b", "Qwen/Qwen3-4B": "qwen3-4b", "Qwen/Qwen3-8B": "qwen3-8b"}
LLAMA_512K = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 8192, "beta_fast": 4.0,
              "beta_slow": 1.0}  # fmt: skip


def _llama31() -> LlamaConfig:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_theta": 500000.0}  # fmt: skip
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=scaling)


def _qwen3(**kw) -> Qwen3Config:
    return Qwen3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=40960, rope_theta=1e6, **kw)


def test_native_positions_of_llama3_qwen3_and_a_yarn_config():
    assert native_positions(_llama31()) == 8192  # its llama3 scaling's original positions, not 131,072
    assert native_positions(_qwen3()) == 32768  # the first Qwen3 release: 40,960 written, 32,768 native
    assert native_positions(Qwen3Config(max_position_embeddings=262144)) == 262144  # Qwen3-2507: native
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}
    assert native_positions(Qwen3Config(max_position_embeddings=131072, rope_parameters=yarn)) == 32768
    assert native_positions(LlamaConfig(max_position_embeddings=2048)) == 2048


def test_transformers_4_config_json_rope_scaling_is_read():
    config = {"model_type": "llama", "max_position_embeddings": 131072, "rope_theta": 500000.0,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}  # fmt: skip
    assert model_rope(config)["rope_type"] == "llama3" and model_rope(config)["rope_theta"] == 500000.0
    assert native_positions(config) == 8192


def test_auto_derives_yarn_over_qwen3s_native_positions():
    plan = plan_rope(_qwen3(), 262144, "auto")
    assert plan.rope_parameters == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32768,
                                    "rope_theta": 1e6}  # fmt: skip
    assert plan.overrides()["max_position_embeddings"] == 262144
    assert "YaRN factor 8 over qwen3's 32,768 native positions" in plan.describe()


def test_auto_over_llama3_keeps_its_base_and_band():
    rope = plan_rope(_llama31(), 1048576, "auto").rope_parameters
    assert rope == {**LLAMA_512K, "factor": 128.0, "rope_theta": 500000.0}  # the 1M recipe's YaRN


def test_auto_replaces_a_shorter_yarn_and_keeps_its_band():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6,
            "beta_fast": 16.0}  # fmt: skip
    plan = plan_rope(Qwen3Config(max_position_embeddings=131072, rope_parameters=yarn), 1048576, "auto")
    assert plan.rope_parameters["factor"] == 32.0 and plan.rope_parameters["beta_fast"] == 16.0


@pytest.mark.parametrize("length", [8192, 40960])
def test_auto_keeps_the_models_rope_within_its_positions(length):
    plan = plan_rope(_qwen3(), length, "auto")
    assert plan.overrides() == {} and "the model's own" in plan.describe()


def test_a_llama_scaling_on_qwen3_is_refused_naming_auto():
    with pytest.raises(ValueError, match=r"original_max_position_embeddings 8,192, but qwen3 was pretrained on "
                       r"32,768 .* rope_parameters: auto \(YaRN factor 8 over 32,768"):  # fmt: skip
        plan_rope(_qwen3(), 262144, LLAMA_512K)


def test_a_scaling_short_of_max_length_is_refused():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ValueError, match="reaches 131,072 positions, fewer than max_length 262,144"):
        plan_rope(_qwen3(), 262144, yarn)
    with pytest.raises(ValueError, match="fewer than max_length"):  # an explicit max_position_embeddings too
        plan_rope(_qwen3(), 262144, {**yarn, "factor": 8.0}, max_position_embeddings=65536)


def test_a_matching_scaling_is_kept_with_the_models_theta():
    plan = plan_rope(_llama31(), 524288, LLAMA_512K)
    assert plan.overrides() == {"rope_parameters": {**LLAMA_512K, "rope_theta": 500000.0},
                                "max_position_embeddings": 524288}  # fmt: skip


def test_no_rope_parameters_keeps_the_model_unchecked():
    assert plan_rope(_qwen3(), 1048576, None).overrides() == {}  # packed short documents need no more positions


def test_auto_refuses_a_rope_type_it_cannot_extend():
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 4096, "rope_theta": 1e4}  # fmt: skip
    config = Phi3Config(hidden_size=32, num_attention_heads=4, max_position_embeddings=131072, rope_parameters=longrope)
    with pytest.raises(ValueError, match="'longrope'"):
        plan_rope(config, 262144, "auto")
    gemma3 = Gemma3TextConfig(hidden_size=32, num_attention_heads=4, head_dim=8)  # a RoPE per layer type
    with pytest.raises(ValueError, match="'per layer type'"):
        plan_rope(gemma3, 262144, "auto")


def _shipped(model: str) -> dict:
    return json.loads((SHIPPED / f"{HUB_NAMES[model]}.json").read_text())


def _lengths(path: Path, recipe: dict) -> set[int]:
    """The recipe's `max_length` and each `--max_length` of its header's launch lines."""
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    extra = {int(line.split("--max_length")[1].split()[0]) for line in header if "--max_length" in line}
    return {recipe["max_length"], *extra}


RECIPES = [
    p
    for p in sorted((ROOT / "recipes").glob("*.yaml"))
    if "rope_parameters" in (recipe := yaml.safe_load(p.read_text()))
    and recipe.get("model_name_or_path") not in (None, "tiny")
]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_rope_fits_the_model_it_names(path):
    recipe = yaml.safe_load(path.read_text())
    for length in _lengths(path, recipe):
        plan_rope(_shipped(recipe["model_name_or_path"]), length, recipe["rope_parameters"])


def test_the_sft_recipe_refuses_the_llama_scaling_for_qwen3_8b(sft_recipe):
    """`--model_name_or_path Qwen/Qwen3-8B --max_length 262144` on the Llama 512K recipe stops before training."""
    module = sft_recipe
    qwen3 = Qwen3Config(**{k: v for k, v in _shipped("Qwen/Qwen3-8B").items() if k != "architectures"})
    recipe = yaml.safe_load((ROOT / "recipes" / "llama31_8b_512k_sp8.yaml").read_text())
    args = SimpleNamespace(max_length=262144)
    lc = module.LongContextArguments(rope_parameters=recipe["rope_parameters"])
    with pytest.raises(ValueError, match="written for another model"):
        module._rope(lc, args, qwen3)
    lc = module.LongContextArguments(rope_parameters="auto")
    assert module._rope(lc, args, qwen3)["rope_parameters"]["factor"] == 8.0

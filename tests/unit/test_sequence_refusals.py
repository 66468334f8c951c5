"""What a model computes over the whole sequence that SP cannot reproduce is refused by name before any step
(`hf_longctx.sequence.refusals`, `attention.semantics`), and only under SP: with one rank the model is whole."""

from __future__ import annotations

import warnings

import pytest

from hf_longctx.attention.registry import check_model
from tests._models import tiny_model

pytest.importorskip("peft", reason="peft is a dev dependency (pip install -e '.[dev]')")

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "pad_token_id": None, "bos_token_id": None,
         "eos_token_id": None}  # fmt: skip


def _auto(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL, **extra))


def _peft(config):
    from peft import get_peft_model

    return get_peft_model(tiny_model("llama"), config)


def _with_peft_type(model, peft_type: str):
    from types import SimpleNamespace

    model.peft_config = {"default": SimpleNamespace(peft_type=peft_type, is_prompt_learning=False)}
    return model


def _inkling():
    from transformers.models.inkling import InklingForCausalLM, InklingTextConfig

    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size")  # fmt: skip
    return InklingForCausalLM(InklingTextConfig(**{k: SMALL[k] for k in keep}))


def _cases():
    from peft import LilyConfig, LoraConfig, PrefixTuningConfig, PromptTuningConfig, ShadowConfig

    return {
        "doge": (lambda: _auto("doge"), "router pairs the scores of different tokens"),
        "prompt_tuning": (
            lambda: _peft(PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
            "PROMPT_TUNING.*virtual tokens",
        ),
        "prefix_tuning": (
            lambda: _peft(PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
            "PREFIX_TUNING.*key/value prefix",
        ),
        "alora": (
            lambda: _peft(LoraConfig(r=2, target_modules="all-linear", alora_invocation_tokens=[5, 6])),
            "activated LoRA",
        ),
        "lily": (lambda: _peft(LilyConfig(r=2, target_modules=["q_proj", "v_proj"])), "LILY.*average router"),
        "shadow": (lambda: _peft(ShadowConfig(task_type="CAUSAL_LM")), "SHADOW.*own attention.*shifts the labels"),
        # X-LoRA loads saved LoRA adapters to build; the refusal reads the adapter's type only.
        "xlora": (lambda: _with_peft_type(tiny_model("llama"), "XLORA"), "XLORA.*runs the model twice"),
        # Query scale and relative bias from a local arange, and short convolutions on k / v (the conv refuses it).
        "inkling": (lambda: _inkling(), "Conv1d over the sequence"),
        "sparse_indexer_layers": (
            lambda: _auto("minimax_m3_vl_text", layer_types=["minimax_m3_sparse", "full_attention"]),
            "minimax_m3_sparse",
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["doge", "prompt_tuning", "prefix_tuning", "alora", "lily", "shadow", "xlora", "inkling", "sparse_indexer_layers"],
)
def test_refused_by_name_under_sp(case):
    build, reason = _cases()[case]
    model = build()
    with pytest.raises(ValueError, match=reason):
        check_model(model, 2)


@pytest.mark.parametrize("case", ["doge", "prompt_tuning", "alora", "lily"])
def test_one_rank_keeps_the_whole_sequence(case):
    check_model(_cases()[case][0](), 1)


def test_plain_lora_is_served():
    from peft import LoraConfig

    check_model(_peft(LoraConfig(r=2, target_modules="all-linear")), 2)

"""The SP model check sees through a PEFT wrapper: a LoRA model resolves to the backend its base model does,
and what the base model cannot run under SP (head counts, soft-capping or sinks under ring) is refused
the same way. (The Trainer checks the model it is handed, which with LoRA is the `PeftModel`.)
"""

from __future__ import annotations

import pytest

from hf_longctx.attention.registry import check_model
from tests._models import tiny_model

pytest.importorskip("peft", reason="peft is a dev dependency (pip install -e '.[dev]')")

NINE = {"num_heads": 9, "num_kv_heads": 3, "hidden": 72}


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, lora_dropout=0.0, target_modules="all-linear"))


@pytest.mark.parametrize(
    ("shape", "sp", "options", "expected"),
    [
        ({}, 2, {"backend": "auto"}, ("ulysses", 2)),
        (NINE, 2, {"backend": "auto"}, ("ring", 1)),
        (NINE, 4, {"backend": "auto"}, ("ring", 1)),
        ({}, 2, {"backend": "ring", "ring_variant": "allgather"}, ("ring", 1)),
        ({}, 4, {"backend": "hybrid", "ulysses_degree": 2}, ("hybrid", 2)),
        ({"num_heads": 6, "num_kv_heads": 2, "hidden": 96}, 4, {"backend": "auto"}, ("hybrid", 2)),
    ],
    ids=["auto-ulysses", "auto-nine-sp2", "auto-nine-sp4", "ring", "hybrid", "auto-hybrid"],
)
def test_lora_model_resolves_like_its_base_model(shape, sp, options, expected):
    plain = check_model(tiny_model("llama", **shape), sp, ranks_per_node=sp, **options)
    wrapped = check_model(_lora(tiny_model("llama", **shape)), sp, ranks_per_node=sp, **options)
    assert (wrapped.name, wrapped.ulysses_degree) == (plain.name, plain.ulysses_degree) == expected
    assert wrapped == plain


@pytest.mark.parametrize(
    ("arch", "extra", "backend", "match"),
    [
        (
            "llama",
            {"num_heads": 3, "num_kv_heads": 1, "hidden": 48},
            "ulysses",
            r"valid sp_size values for this model: \[1, 3\]",
        ),
        ("gemma2", {"attn": "eager"}, "ring", "soft-capping"),
        ("gpt_oss", {"attn": "eager"}, "ring", "attention sinks"),
    ],
    ids=["heads3-ulysses", "softcap-ring", "sinks-ring"],
)
def test_what_the_base_model_cannot_run_is_refused_through_the_wrapper(arch, extra, backend, match):
    for model in (tiny_model(arch, **extra), _lora(tiny_model(arch, **extra))):
        with pytest.raises(ValueError, match=match):
            check_model(model, 2, backend)

"""The planner names the attention kernel a run uses, its terms follow that kernel, and it warns where transformers
would build a [S, S] mask (a model hf_longctx leaves to transformers at --sp 1)."""

from __future__ import annotations

import json

from hf_longctx.cli import main
from hf_longctx.planner import DEVICES, RunConfig, estimate
from hf_longctx.planner.model_shape import ModelShape, load_model_shape

LLAMA = load_model_shape("llama3.1-8b")


def _vlm(tmp_path, model_type: str = "gemma3") -> str:
    text = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
            "intermediate_size": 2048, "vocab_size": 1000}  # fmt: skip
    config = {"model_type": model_type, "text_config": text, "vision_config": {"depth": 2}}
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_kernel_named_per_attn_device_and_dtype():
    def kernel(**kw):
        fields = {"seq_len": 65536, **kw}
        device = DEVICES["cpu" if kw.pop("cpu", False) else "h200"]
        fields.pop("cpu", None)
        return estimate(LLAMA, RunConfig(**fields), device).attention_kernel

    assert kernel(attn="flash").startswith("flash-attn 2") and "per document, no mask" in kernel(attn="flash")
    assert kernel(attn="sdpa").startswith("torch's FlashAttention-2")
    assert kernel(attn="sdpa", dtype="fp32").startswith("torch's memory-efficient kernel")
    assert kernel(attn="sdpa", cpu=True).startswith("torch's CPU flash kernel")
    assert kernel(attn="eager").startswith("eager, per document in query blocks")
    assert "tiled_layer" in kernel(attn="sdpa", tiled_layer=True)


def test_sdpa_on_a_gpu_plans_flash_attention_2s_backward_terms():
    """Without flash-attn, sdpa's flash backend is torch's FlashAttention-2: the same memory as flash-attn's."""
    run = RunConfig(seq_len=131072, gradient_checkpointing=True)
    flash, sdpa = (
        estimate(LLAMA, RunConfig(**{**run.__dict__, "attn": a}), DEVICES["h200"]) for a in ("flash", "sdpa")
    )
    assert sdpa.peak_gib == flash.peak_gib and sdpa.breakdown == flash.breakdown


def test_a_model_left_to_transformers_at_sp1_warns_of_its_mask(tmp_path, capsys):
    assert load_model_shape(_vlm(tmp_path, "qwen2_5_vl")).own_attention == ""  # served at sp_size=1 too
    shape = load_model_shape(_vlm(tmp_path))
    assert isinstance(shape, ModelShape) and shape.own_attention.startswith("a vision-language model")
    plan = estimate(shape, RunConfig(seq_len=1_000_000, attn="sdpa"), DEVICES["h200"])
    assert any("[S, S] mask, 931.323 GiB" in w for w in plan.warnings), plan.warnings
    assert "the model's own attention" in plan.attention_kernel
    assert not estimate(shape, RunConfig(seq_len=1_000_000, world=2, sp=2, attn="sdpa"), DEVICES["h200"]).warnings
    assert not estimate(LLAMA, RunConfig(seq_len=1_000_000, attn="sdpa"), DEVICES["h200"]).warnings
    eager = RunConfig(seq_len=8192, attn="eager")
    eager_own = estimate(shape, eager, DEVICES["h200"])
    eager_served = estimate(ModelShape(**{**shape.__dict__, "own_attention": ""}), eager, DEVICES["h200"])
    assert eager_own.peak_gib - eager_served.peak_gib >= 8192**2 * 2 / 2**30 * 0.99  # transformers' [S, S] mask
    main(["plan", "--model", _vlm(tmp_path), "--seq-len", "1000000", "--attn", "sdpa"])
    out = capsys.readouterr().out
    assert "attention kernel: torch's FlashAttention-2" in out and "WARNING: hf_longctx leaves" in out

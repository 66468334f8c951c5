"""The planner counts sliding-window and chunked layers as they run (issue 38): per layer type, with the kernel named.

Config parsing follows transformers' rules for `layer_types`; a windowed layer on sdpa / eager holds its band's
K/V windows (`attention/blocks.py`), on flash-attn nothing more than a full layer; chunked layers run per chunk;
`tiled_layer` tiles the full layers only. The CPU numbers themselves are measured in
`benchmarks/window_scaling.py` (results in benchmarks/results).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from hf_longctx.attention.blocks import band_rows, plan_segment
from hf_longctx.planner import DEVICES, ModelShape, RunConfig, estimate
from hf_longctx.planner.layers import layer_stack
from hf_longctx.planner.terms import layer_bytes, norm_bytes, segment_scores

BASE = {"hidden_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
        "intermediate_size": 8192, "vocab_size": 32000}  # fmt: skip


def _shape(**config) -> ModelShape:
    return ModelShape.from_config({**BASE, **config}, name="m")


@pytest.mark.parametrize(
    ("config", "sliding", "chunked"),
    [
        ({"sliding_window": 4096, "model_type": "mistral"}, 12, 0),  # Mistral: every layer
        ({"sliding_window": 4096, "use_sliding_window": False, "model_type": "qwen2"}, 0, 0),
        ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 8}, 4, 0),  # Qwen2: from 8 on
        ({"sliding_window": 512, "model_type": "gemma3_text"}, 10, 0),  # every 6th layer full
        ({"sliding_window": 4096, "model_type": "gemma2"}, 6, 0),  # alternating
        ({"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 6}, 6, 0),  # gpt-oss
        ({"attention_chunk_size": 8192, "model_type": "llama4_text"}, 0, 9),  # every 4th layer full
        ({"attention_chunk_size": 8192, "no_rope_layers": [1, 0] * 6}, 0, 6),
        ({}, 0, 0),
    ],
)
def test_layer_types_are_read_as_transformers_derives_them(config, sliding, chunked):
    kinds = _shape(**config).layer_kinds()
    assert kinds.get("sliding_attention", 0) == sliding and kinds.get("chunked_attention", 0) == chunked
    assert sum(kinds.values()) == 12


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("window", [32, 64, 100])
def test_windowed_layer_saved_bytes_match_autograd(attn, dtype, window):
    """A Mistral whose every layer has a window, under hf_longctx without SP: the bytes autograd saves equal the
    planner's count (the band's K/V windows, their masks and outputs; windows of 32 / 64 / 100 give a masked
    first block, an unmasked one, and a rest block)."""
    import hf_longctx
    from tests.unit.test_planner import TINY, _saved_bytes

    config = MistralConfig(**TINY, use_cache=False, attn_implementation=attn, sliding_window=window)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32).train()
    tokens = 256
    with hf_longctx.enable_sequence_parallel(model, hf_longctx.SequenceParallelGroups.single()):
        measured = _saved_bytes(model, torch.randint(0, TINY["vocab_size"], (1, tokens)))
    shape = ModelShape.from_config({**config.to_dict(), "model_type": "mistral"})
    assert shape.layer_kinds() == {"sliding_attention": TINY["num_hidden_layers"]}
    run = RunConfig(seq_len=tokens, dtype=dtype, attn=attn)
    layer = layer_bytes(shape, run, tokens, True, "sliding_attention")
    extra = 8 * tokens + 2 * tokens * shape.head_dim * run.act_bytes  # as test_planner: int64 ids, RoPE's cos/sin
    predicted = shape.layers * layer.saved + tokens * norm_bytes(shape.hidden, run.act_bytes, False) + extra
    assert predicted == measured
    full = layer_bytes(shape, run, tokens, True, "full_attention")
    assert layer.saved != full.saved  # the band is counted, not the full layer's terms


def test_windowed_layer_names_its_kernel_and_flash_takes_the_window_itself():
    full, windowed = _shape(), _shape(sliding_window=1024, model_type="mistral")
    run = RunConfig(seq_len=65536, world=2, sp=2, dtype="fp32", attn="sdpa", engine="ddp")
    cpu = dataclasses.replace(DEVICES["cpu"], capacity_gib=1e9)
    kernel = estimate(windowed, run, cpu).attention_kernel
    assert f"band of {band_rows(1024)}-query blocks against 2047 keys" in kernel
    assert kernel.startswith("sliding-window layers (12): torch's CPU flash kernel")
    assert estimate(windowed, run, cpu).peak_gib > estimate(full, run, cpu).peak_gib  # the K/V windows (4 / 2 heads)
    flash = RunConfig(seq_len=65536, attn="flash")
    h200 = DEVICES["h200"]
    assert estimate(windowed, flash, h200).peak_gib == estimate(full, flash, h200).peak_gib  # its window argument
    assert "with its window argument" in estimate(windowed, flash, h200).attention_kernel
    gpu_sdpa = estimate(windowed, RunConfig(seq_len=65536, attn="sdpa"), h200).attention_kernel
    assert "memory-efficient kernel (sdpa, masked)" in gpu_sdpa


def test_eager_scores_follow_the_band_and_the_chunks():
    """Eager's scores: O(S x W) with a window, S x chunk with chunks, against S^2 / 2 for a full layer."""
    seq = 65536
    assert segment_scores(seq, 512, None) == sum(b.scores for b in plan_segment(seq, 512, True))
    assert segment_scores(seq, 512, None) <= seq * (band_rows(512) + 511)
    assert segment_scores(seq, None, 4096) == 16 * sum(b.scores for b in plan_segment(4096, None, True))
    run = RunConfig(seq_len=seq, world=2, sp=2, attn="eager", dtype="fp32")
    h200 = DEVICES["h200"]
    full = estimate(_shape(), run, h200).peak_gib
    assert estimate(_shape(sliding_window=512, model_type="mistral"), run, h200).peak_gib < full / 4
    assert estimate(_shape(attention_chunk_size=4096, no_rope_layers=[1] * 12), run, h200).peak_gib < full / 4


def test_tiled_layer_tiles_the_full_layers_only():
    gemma = _shape(sliding_window=512, model_type="gemma3_text")
    run = RunConfig(seq_len=131072, tiled_layer=True, attn="sdpa")
    stack = layer_stack(gemma, run, 131072, False)
    by_kind = {k.kind: k for k in stack.kinds}
    assert by_kind["full_attention"].tiled and by_kind["full_attention"].checkpointed
    assert not by_kind["sliding_attention"].tiled and not by_kind["sliding_attention"].checkpointed
    kernel = estimate(gemma, run, DEVICES["h200"]).attention_kernel
    assert "full layers (2): " in kernel and "tiled_layer" in kernel and "sliding-window layers (10): " in kernel
    # With gradient checkpointing the untiled windowed layers keep only their input too.
    ckpt = layer_stack(gemma, dataclasses.replace(run, gradient_checkpointing=True), 131072, False)
    assert all(k.checkpointed for k in ckpt.kinds)
    assert (
        estimate(gemma, dataclasses.replace(run, gradient_checkpointing=True), DEVICES["h200"]).peak_gib
        < estimate(gemma, run, DEVICES["h200"]).peak_gib
    )


def test_windows_and_chunks_longer_than_the_sequence_cost_what_a_full_layer_costs():
    run = RunConfig(seq_len=2048, attn="sdpa", dtype="fp32")
    cpu = DEVICES["cpu"]
    full = estimate(_shape(), run, cpu).peak_gib
    assert estimate(_shape(sliding_window=4096, model_type="mistral"), run, cpu).peak_gib == full
    assert estimate(_shape(attention_chunk_size=8192, no_rope_layers=[1] * 12), run, cpu).peak_gib == full


def test_inconsistent_layer_types_are_refused():
    with pytest.raises(ValueError, match="layer_types"):
        ModelShape(name="x", hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=8, vocab=8,
                   layer_types=("full_attention",))  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window"):
        ModelShape(name="x", hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, intermediate=8, vocab=8,
                   layer_types=("sliding_attention",))  # fmt: skip

"""The planner counts sliding-window and chunked layers as they run (issue 38): per layer type, with the kernel named.

Config parsing follows transformers' rules for `layer_types`; a windowed layer on sdpa / eager holds its band's
K/V windows (`attention/blocks.py`), on flash-attn nothing more than a full layer; chunked layers run per chunk;
`tiled_layer` tiles the full layers only. The CPU numbers themselves are measured in
`benchmarks/window_scaling.py` (results in benchmarks/results).
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_longctx.attention.blocks import band_rows, plan_segment
from hf_longctx.planner import DEVICES, ModelShape, RunConfig, estimate
from hf_longctx.planner.layers import layer_stack
from hf_longctx.planner.terms import band_keys, segment_scores

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


def test_a_windowed_layer_on_sdpa_keeps_its_bands_kv_windows_and_names_its_kernel():
    full, windowed = _shape(), _shape(sliding_window=1024, model_type="mistral")
    run = RunConfig(seq_len=65536, world=2, sp=2, dtype="fp32", attn="sdpa", engine="ddp")
    cpu = dataclasses.replace(DEVICES["cpu"], capacity_gib=1e9)
    tokens = 32768
    (f,), (w,) = layer_stack(full, run, tokens, True).kinds, layer_stack(windowed, run, tokens, True).kinds
    a, heads, d = 4, 16, 128
    keys = band_keys(65536, 1024, eager=False)
    assert keys == sum(b.repeat * b.keys for b in plan_segment(65536, 1024, False)) / 65536
    assert 1.9 < keys < 2.0  # rows of 1024 against 2047 keys
    # The band's windows (K and V, expanded to the query heads) and the blocks' outputs concatenated.
    assert w.bytes.saved - f.bytes.saved == pytest.approx(2 * a * tokens * heads * d * keys + a * tokens * heads * d)
    kernel = estimate(windowed, run, cpu).attention_kernel
    assert (
        f"band of {band_rows(1024)}-query blocks against 2047 keys" in kernel and "sliding-window layers (12)" in kernel
    )
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

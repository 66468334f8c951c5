"""`hf-longctx check` on vision-language configs: the shrunk vision tower, the image rows, the refusals."""

from __future__ import annotations

import pytest
import torch
import transformers

from hf_longctx.check import MAX_VOCAB, shrink_config
from hf_longctx.check.model import build_model, check_batch
from hf_longctx.check.vlm import check_supported, reference_outputs
from hf_longctx.multimodal.mrope import document_rope_positions

_TEXT = {"vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
_ROPE = {
    "qwen2_5_vl": {"rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
    "qwen3_vl": {"rope_scaling": {"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True}},
}


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def shrunk(request, tmp_path_factory):
    """The architecture's default (full-size) vision tower over a small decoder, shrunk the way the check
    does (hidden 128 -> 64, so the rotary sections must follow), and its model."""
    original = transformers.AutoConfig.for_model(request.param, text_config={**_TEXT, **_ROPE[request.param]})
    config, notes = shrink_config(original, layers=2, hidden=64, min_positions=128, attn="sdpa")
    folder = tmp_path_factory.mktemp(request.param)
    config.save_pretrained(folder)
    return config, notes, build_model(folder, "sdpa", seed=0)


def test_vision_tower_is_small_and_feeds_the_shrunk_decoder(shrunk):
    config, notes, model = shrunk
    vision, text = config.vision_config, config.get_text_config()
    assert (vision.depth, vision.hidden_size, vision.num_heads) == (2, 32, 2)
    assert vision.out_hidden_size == text.hidden_size == 64
    assert any(n.startswith("vision tower ") for n in notes), notes
    assert "mrope_section [4, 6, 6] -> [2, 3, 3]" in notes
    ids = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    assert sorted(ids) == list(range(MAX_VOCAB - 4, MAX_VOCAB))
    assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_image_rows_match_their_grids(shrunk):
    config, _, model = shrunk
    merge = config.vision_config.spatial_merge_size
    batch = check_batch(model, seq_len=41, batch_size=3, packed=False, seed=0)
    image = batch["input_ids"] == config.image_token_id
    grids = batch["image_grid_thw"]
    assert int(image.sum()) == int((grids.prod(-1) // merge**2).sum())
    assert batch["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    assert image[1].sum() == 0 and image[0].sum() == 8 and image[2].sum() == 4  # two, none, one
    assert image[0, 41 // 2 - 1] and image[0, 41 // 2]  # an image across the middle (the SP=2 boundary)
    assert bool((batch["labels"][image] == -100).all())
    if "mm_token_type_ids" in batch:
        assert torch.equal(batch["mm_token_type_ids"], image.long())
    assert torch.equal(batch["input_ids"], check_batch(model, 41, 3, False, 0)["input_ids"])  # deterministic


def test_packed_reference_runs_each_document_alone(shrunk):
    """The packed reference (each document alone, with its images) equals the packed row run with per-document
    positions, and differs from the whole-row run: the images stay in their documents."""
    config, _, model = shrunk
    batch = check_batch(model, seq_len=41, batch_size=3, packed=True, seed=0)
    assert batch["position_ids"][:, 1:].eq(0).sum() == 2 * 3  # three documents per row
    with torch.no_grad():
        logits, outputs = reference_outputs(model, batch)
        assert len(outputs) == 9
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "position_ids")}
        positions = document_rope_positions(model.model, batch, batch["position_ids"])
        packed = model(**inputs, position_ids=positions, use_cache=False).logits
        whole, _ = reference_outputs(model, {k: v for k, v in batch.items() if k != "position_ids"})
    assert float((logits - packed).abs().max()) < 1e-5
    assert float((logits - whole).abs().max()) > 1e-3


def test_refusals_name_the_reason():
    with pytest.raises(ValueError, match="lacks spatial_merge_size, temporal_patch_size"):
        check_supported(transformers.AutoConfig.for_model("llava_next"), seq_len=67, packed=False)
    with pytest.raises(ValueError, match="one document per row for vision-language models"):
        check_supported(transformers.AutoConfig.for_model("llava"), seq_len=67, packed=True)
    qwen = transformers.AutoConfig.for_model("qwen2_5_vl")
    check_supported(qwen, seq_len=67, packed=True)  # packed Qwen rows: per-document mRoPE positions
    with pytest.raises(ValueError, match="--seq-len must be >= 24"):
        check_supported(qwen, seq_len=16, packed=False)


def test_numerically_zero_gradients_are_measured_against_the_largest():
    from hf_longctx.check.model import StepResult
    from hf_longctx.check.report import compare

    ref = {"w": torch.tensor([1.0, -0.5]), "k_bias": torch.tensor([1e-12]), "unused": torch.zeros(2),
           "small": torch.tensor([1e-3]), "zero": torch.zeros(1)}  # fmt: skip
    sp = {"w": torch.tensor([1.0, -0.5]), "k_bias": torch.tensor([3e-12]), "unused": torch.zeros(2),
          "small": torch.tensor([2e-3]), "zero": torch.tensor([1e-3])}  # fmt: skip
    cmp = compare(1.0, sp, StepResult(1.0, ref, ""))
    errors = dict(cmp.grad_errors)
    assert cmp.zero_grads == ["k_bias", "zero"]  # not "unused" (exactly zero on both sides)
    assert errors["k_bias"] == pytest.approx(2e-12) and errors["unused"] == 0.0
    assert errors["small"] == pytest.approx(1.0)  # small but not zero: its own scale
    assert errors["zero"] == pytest.approx(1e-3)  # a real error where the reference has none still shows

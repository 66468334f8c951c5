"""Per-document mRoPE positions of packed rows (`hf_longctx.multimodal.mrope`), no process group.

The positions equal the model's own `get_rope_index` run on each document alone (images and videos, Qwen2.5-VL's
`second_per_grid_ts`, Qwen3-VL's per-frame video spans); and a packed row run with them gives every document the
logits it has alone, which transformers' own positions for the packed row (per row, or the 1-D packed ones) do not.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.multimodal.mrope import _media_documents, document_rope_positions, document_spans
from tests.dist import _vlm as V
from tests.dist import _vlm_packed as P

CASES = ("padding_free", "packed_mask", "videos")


@pytest.fixture(scope="module", params=V.ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(arch) -> torch.nn.Module:
    return V.build(arch).eval()


def _alone(model: torch.nn.Module, doc: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[3, sl]`: the model's own positions of a single-document row (1-D on every axis without images)."""
    keys = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    if "image_grid_thw" not in doc and "video_grid_thw" not in doc:
        return torch.arange(doc["input_ids"].shape[1]).expand(3, -1)
    return model.model.get_rope_index(**{k: doc[k] for k in keys if k in doc})[0][:, 0]


@pytest.mark.parametrize("case", CASES)
def test_positions_are_each_documents_own(arch, model, case):
    batch = P.cases(arch)[case]
    positions = document_rope_positions(model.model, batch, batch["position_ids"])
    assert positions.shape == (4, *batch["input_ids"].shape)
    assert torch.equal(positions[0], batch["position_ids"])
    for b, docs in enumerate(P.documents(arch)[case]):
        start = 0
        for doc in docs:
            n = doc["input_ids"].shape[1]
            got = positions[1:, b, start : start + n]
            assert torch.equal(got, _alone(model, doc)), (case, b, start)
            assert not doc["mm_token_type_ids"].any() or not torch.equal(got[1], got[0])  # images: really 3-D
            start += n
        assert not positions[:, b, start:].any()  # TRL's padding: position 0, text


def test_a_videos_own_seconds_are_used():
    """Qwen2.5-VL spaces a video's frames by its `second_per_grid_ts`: another video's would give other
    positions, so the per-document slice of them is tested by `test_positions_are_each_documents_own`."""
    model = V.build("qwen2_5_vl")
    doc = P.video_document("qwen2_5_vl", 3, 42, 2.0)
    assert not torch.equal(_alone(model, {**doc, "second_per_grid_ts": torch.tensor([0.5])}), _alone(model, doc))


def test_an_image_across_a_document_boundary_is_refused(model):
    batch = P.cases("qwen2_5_vl")["padding_free"]
    cut = batch["position_ids"].clone()
    cut[0, 5:] -= 5  # a document starting inside the first image (tokens 3-6)
    with pytest.raises(ValueError, match="crosses a document boundary"):
        document_rope_positions(model.model, batch, cut)


def test_without_token_types_or_grids_every_axis_is_the_1d_position(model):
    batch = P.cases("qwen2_5_vl")["padding_free"]
    for key in ("mm_token_type_ids", "image_grid_thw"):
        without = {k: v for k, v in batch.items() if k != key}
        positions = document_rope_positions(model.model, without, batch["position_ids"])
        assert torch.equal(positions, batch["position_ids"].expand(4, -1, -1))


def test_document_spans():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_spans(pos) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)]]


def test_only_documents_with_images_or_videos_are_visited():
    """Padding that restarts positions at every token is thousands of one-token documents: they are counted at
    once and skipped, and the media documents come with their image / video token counts."""
    valid = torch.tensor([0, 1, 1, 0, 2, 2, 2, 0] + [0] * 5000)
    spans = [(0, 3), (3, 4), (4, 8)] + [(8 + i, 9 + i) for i in range(5000)]
    assert _media_documents(valid, spans) == [(0, 3, {1: 2, 2: 0}), (4, 8, {1: 0, 2: 3})]
    assert _media_documents(valid[:0], []) == []


@pytest.mark.parametrize("case", CASES)
def test_packed_row_gives_each_document_its_own_logits(arch, model, case):
    """The reference semantics: transformers 5.25 run on the packed row with per-document positions (4 rows: it
    reads the documents from the first and builds the packed mask, with no attention_mask and no cache) gives
    each document the logits it has alone; with its own positions (per row, or the packed 1-D ones) it does not."""
    batch = P.cases(arch)[case]
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask", "position_ids")}
    with torch.no_grad():
        alone = [[model(**doc, use_cache=False).logits[0] for doc in docs] for docs in P.documents(arch)[case]]
        ours = document_rope_positions(model.model, batch, batch["position_ids"])
        runs = {name: model(**inputs, position_ids=pos, use_cache=False).logits
                for name, pos in (("ours", ours), ("1d", batch["position_ids"]), ("row", None))}  # fmt: skip
    for name, logits in runs.items():
        worst = 0.0
        for b, row in enumerate(alone):
            start = 0
            for want in row:
                worst = max(worst, float((logits[b, start : start + len(want)] - want).abs().max()))
                start += len(want)
        assert (worst < 1e-5) == (name == "ours"), (case, name, worst)

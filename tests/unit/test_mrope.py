"""Per-document mRoPE positions of packed rows (`hf_longctx.multimodal.mrope`), no process group.

The positions equal the model's own `get_rope_index` run on each document alone (images and videos, Qwen2.5-VL's
`second_per_grid_ts`, Qwen3-VL's per-frame video grids); and a packed row run with them gives every document the
logits it has alone, which transformers' own positions for the packed row (per row, or the 1-D packed ones) do not.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.multimodal.mrope import document_rope_positions, document_spans
from tests.dist import _vlm as V
from tests.dist import _vlm_packed as P


@pytest.fixture(scope="module", params=V.ARCHS)
def model(request) -> torch.nn.Module:
    return V.build(request.param).eval()


def _alone(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[3, sl]`: the model's own positions of a single-document row."""
    keys = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
    return model.model.get_rope_index(**{k: batch[k] for k in keys if k in batch})[0][:, 0]


@pytest.mark.parametrize("case", ["padding_free", "packed_mask"])
def test_positions_are_each_documents_own(model, case):
    batch, rows = P.cases()[case], P.layouts()[case]
    positions = document_rope_positions(model.model, batch, batch["position_ids"])
    assert positions.shape == (4, *batch["input_ids"].shape)
    assert torch.equal(positions[0], batch["position_ids"])
    for b, docs in enumerate(rows):
        start = 0
        for doc in docs:
            got = positions[1:, b, start : start + doc[0]]
            want = _alone(model, P.document(doc)) if doc[1] else torch.arange(doc[0]).expand(3, -1)
            assert torch.equal(got, want), (case, b, start)
            assert doc[1] == [] or not torch.equal(got[1], got[0])  # images: really 3-D
            start += doc[0]
        assert not positions[:, b, start:].any()  # TRL's padding: position 0, text


def _video_doc(model: torch.nn.Module, frames: int, seed: int) -> dict[str, torch.Tensor]:
    """Text, a `frames`-frame 4x4 video (Qwen3-VL: frames apart, a timestamp token before each), text."""
    qwen3 = "Qwen3" in type(model).__name__
    ids = torch.randint(3, 140, (3,), generator=torch.Generator().manual_seed(seed)).tolist()
    if qwen3:  # one vision span per frame, each after its timestamp token
        ids += [7, V.START, *[V.VIDEO] * 4, V.END] * frames
    else:
        ids += [V.START, *[V.VIDEO] * 4 * frames, V.END]
    ids += [9, 10]
    ids_t = torch.tensor([ids])
    return {"input_ids": ids_t, "mm_token_type_ids": (ids_t == V.VIDEO).long() * 2,
            "video_grid_thw": torch.tensor([[frames, 4, 4]])}  # fmt: skip


def test_videos_and_their_seconds_follow_their_documents(model):
    image = P.document(P.PADDING_FREE[0][0])
    docs = [_video_doc(model, 2, seed=1), image, _video_doc(model, 3, seed=2)]
    if "Qwen2_5" in type(model).__name__:  # distinct seconds per video: a shifted slice would show
        docs[0]["second_per_grid_ts"], docs[2]["second_per_grid_ts"] = torch.tensor([0.5]), torch.tensor([2.0])
    batch = {
        "input_ids": torch.cat([d["input_ids"] for d in docs], 1),
        "mm_token_type_ids": torch.cat([d["mm_token_type_ids"] for d in docs], 1),
        "image_grid_thw": image["image_grid_thw"],
        "video_grid_thw": torch.cat([docs[0]["video_grid_thw"], docs[2]["video_grid_thw"]]),
    }
    if "second_per_grid_ts" in docs[0]:
        batch["second_per_grid_ts"] = torch.cat([docs[0]["second_per_grid_ts"], docs[2]["second_per_grid_ts"]])
    position_ids = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]
    positions = document_rope_positions(model.model, batch, position_ids)
    start = 0
    for doc in docs:
        n = doc["input_ids"].shape[1]
        assert torch.equal(positions[1:, 0, start : start + n], _alone(model, doc))
        start += n
    if "second_per_grid_ts" in docs[2]:  # the seconds matter: another video's would give other positions
        swapped = {**docs[2], "second_per_grid_ts": docs[0]["second_per_grid_ts"]}
        assert not torch.equal(_alone(model, swapped), _alone(model, docs[2]))


def test_an_image_across_a_document_boundary_is_refused(model):
    batch = P.cases()["padding_free"]
    cut = batch["position_ids"].clone()
    cut[0, 5:] -= 5  # a document starting inside the first image (tokens 3-6)
    with pytest.raises(ValueError, match="crosses a document boundary"):
        document_rope_positions(model.model, batch, cut)


def test_without_token_types_or_grids_every_axis_is_the_1d_position(model):
    batch = P.cases()["padding_free"]
    for key in ("mm_token_type_ids", "image_grid_thw"):
        without = {k: v for k, v in batch.items() if k != key}
        positions = document_rope_positions(model.model, without, batch["position_ids"])
        assert torch.equal(positions, batch["position_ids"].expand(4, -1, -1))


def test_document_spans():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    assert document_spans(pos) == [[(0, 3), (3, 5), (5, 6)], [(0, 6)]]


@pytest.mark.parametrize("case", ["padding_free", "packed_mask"])
def test_packed_row_gives_each_document_its_own_logits(model, case):
    """The reference semantics: transformers 5.25 run on the packed row with per-document positions (4 rows: it
    reads the documents from the first and builds the packed mask, with no attention_mask and no cache) gives
    each document the logits it has alone; with its own positions (per row, or the packed 1-D ones) it does not."""
    batch, rows = P.cases()[case], P.layouts()[case]
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask", "position_ids")}
    with torch.no_grad():
        alone = [[model(**P.document(doc), use_cache=False).logits[0] for doc in docs] for docs in rows]
        ours = document_rope_positions(model.model, batch, batch["position_ids"])
        runs = {name: model(**inputs, position_ids=pos, use_cache=False).logits
                for name, pos in (("ours", ours), ("1d", batch["position_ids"]), ("row", None))}  # fmt: skip
    for name, logits in runs.items():
        worst = 0.0
        for b, docs in enumerate(rows):
            start = 0
            for doc, want in zip(docs, alone[b], strict=True):
                worst = max(worst, float((logits[b, start : start + doc[0]] - want).abs().max()))
                start += doc[0]
        assert (worst < 1e-5) == (name == "ours"), (case, name, worst)

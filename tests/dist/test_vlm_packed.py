"""Packed and padding-free rows of Qwen2.5-VL / Qwen3-VL under SP are exact (`hf_longctx/multimodal/mrope.py`).

transformers 5.25 computes mRoPE positions per row, so its own run of a packed row is no reference. The reference
here is each document run alone through the plain model (no hf_longctx; its own mRoPE positions from its own image
and video grids), the token losses summed over every document and divided by their count, as the packed batch
counts them: the loss and every parameter's gradient at SP=2 (Ulysses, ring) and SP=4 (Ulysses). It shares no code
with `hf_longctx.multimodal.mrope`. Images straddle
the shard boundaries; one row has no attention_mask (padding-free), another case has two right-padded rows, and a
third a padding-free row with an image and two videos across the boundaries.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed
from tests.dist import _vlm as V
from tests.dist import _vlm_packed as P
from tests.dist import _vlm_packed_trainer as T
from tests.dist._parity import GRAD_RTOL, grad_errors
from tests.dist._trainer_utils import compare_logs

BACKENDS = {2: ("ulysses", "ring"), 4: ("ulysses",)}


def _reference(arch: str, name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Each document of case `name` alone through the plain model: the summed token loss of all over their count
    (a document's first token and its image / video tokens carry no label, as in the packed rows)."""
    model = V.build(arch)
    total, count = torch.zeros(()), 0
    for doc in (doc for row in P.documents(arch)[name] for doc in row):
        ids = doc["input_ids"]
        labels = ids.masked_fill((ids == V.IMAGE) | (ids == V.VIDEO), -100)[0, 1:]
        logits = model(**doc, use_cache=False).logits[0, :-1]
        total = total + F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    loss = total / count
    loss.backward()
    return loss.item(), V.all_grads(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_vlm_matches_single_process(world_size, record_property):
    results = run_distributed(V.cases_worker, world_size, V.ARCHS, BACKENDS[world_size], True, timeout=400)[0]
    refs = {(arch, name): _reference(arch, name) for arch in V.ARCHS for name in P.cases(arch)}
    assert len(results) == len(V.ARCHS) * len(BACKENDS[world_size]) * len(P.cases(V.ARCHS[0]))
    worst = V.compare_cases(results, refs)
    assert all(any(V.vision_parameter(k) and float(g.abs().max()) > 0 for k, g in grads.items())
               for _, grads in refs.values())  # fmt: skip
    record_property("max_grad_rel", worst)


def _steps_match(worker, tmp_path, arch: str) -> tuple[dict[str, float], dict]:
    """`worker` at SP=2 against one process with documents kept apart (`doc_exact`): per-step loss and
    grad_norm, and every parameter's gradient in the first step; returns the worst differences and the reference."""
    ref = run_distributed(worker, 1, str(tmp_path / "ref"), arch, True, timeout=300)[0]
    runs = run_distributed(worker, 2, str(tmp_path / "sp"), arch, False, timeout=300)
    assert len(ref["logs"]) == 3
    assert ref["attn"].startswith("hf_longctx_ulysses"), ref["attn"]  # sp_size=1 served by hf_longctx too
    assert min(ref["documents"]) >= 2, ref["documents"]  # every batch a padding-free row of several documents
    worst = {}
    for result in runs:
        assert result["attn"].startswith("hf_longctx_ulysses"), result["attn"]
        worst.update(compare_logs(result["logs"], ref["logs"], ("loss", "grad_norm"), 1e-5))
        errors = grad_errors(result["first_grads"], ref["first_grads"])
        assert max(errors.values()) <= GRAD_RTOL, {k: v for k, v in errors.items() if v > GRAD_RTOL}
        worst["first_grads"] = max(errors.values())
    return worst, ref


@pytest.mark.parametrize("arch", V.ARCHS)
def test_padding_free_trainer_steps_match(arch, tmp_path, record_property):
    """The stock Trainer on padding-free rows of documents with images (TRL's padding-free layout)."""
    worst, ref = _steps_match(T.trainer_worker, tmp_path, arch)
    assert any(V.vision_parameter(k) and float(g.abs().max()) > 0 for k, g in ref["first_grads"].items())
    record_property("max_rel_diff", worst)


def test_sft_trainer_on_padding_free_media_rows_steps_match(tmp_path, record_property):
    """TRL's SFTTrainer on padding-free rows of documents with images, videos (2 and 3 frames) and text only,
    across the SP shards (processed rows with `skip_prepare_dataset` and a packing collator: TRL 1.16 refuses
    `packing` and `padding_free` for vision datasets): SP=2 with Ulysses, SP=4 with auto, and SP=2 with the
    vision tower frozen, each against sp_size=1. Qwen3-VL, with DeepStack and its per-frame video spans."""
    arch, worst, refs = "qwen3_vl", {}, {}
    for frozen in (False, True):
        ref = run_distributed(T.sft_media_worker, 1, str(tmp_path / f"ref{frozen}"), arch, "ulysses", frozen,
                              timeout=300)[0]  # fmt: skip
        assert len(ref["logs"]) == 3 and min(ref["documents"]) >= 2, ref
        tower = [g for k, g in ref["first_grads"].items() if V.vision_parameter(k)]
        assert (not tower) if frozen else any(float(g.abs().max()) > 0 for g in tower)
        refs[frozen] = ref
    for world_size, backend, frozen in ((2, "ulysses", False), (4, "auto", False), (2, "ulysses", True)):
        runs = run_distributed(T.sft_media_worker, world_size, str(tmp_path / f"{backend}{frozen}"), arch, backend,
                               frozen, timeout=300)  # fmt: skip
        ref = refs[frozen]
        for result in runs:
            assert result["attn"].startswith("hf_longctx_"), result["attn"]
            found = compare_logs(result["logs"], ref["logs"], ("loss", "grad_norm"), 1e-5)
            assert set(result["first_grads"]) == set(ref["first_grads"])
            errors = grad_errors(result["first_grads"], ref["first_grads"])
            assert max(errors.values()) <= GRAD_RTOL, {k: v for k, v in errors.items() if v > GRAD_RTOL}
            worst[f"sp{world_size}{' frozen' if frozen else ''}"] = max(*found.values(), max(errors.values()))
    record_property("max_rel_diff", worst)


@pytest.mark.parametrize("arch", V.ARCHS)
def test_packed_sft_trainer_steps_match(arch, tmp_path, record_property):
    """TRL's SFTTrainer with packing=True on a VLM (text documents: TRL 1.16 refuses packing for images)."""
    worst, _ = _steps_match(T.sft_worker, tmp_path, arch)
    record_property("max_rel_diff", worst)

"""The vision tower sharded over the SP group (`hf_longctx/multimodal/vision_shard.py`) is exact, and sharded.

Qwen2.5-VL, Qwen3-VL (DeepStack) and InternVL (cut by frame or image), and LLaVA with a Pixtral tower (not
cut: it joins all images into one sequence, so it runs whole on every rank), at SP=2 and SP=4 against the plain
model on the whole batch: the loss and every parameter's gradient, the vision tower's included; a video whose
frames and an image straddle the shards, fewer images than ranks (ranks that encode a stand-in), a text-only
row next to images, a frozen tower, and FSDP2 with the tower's blocks as their own units. Every case also
checks the pixel rows each rank's tower received: together the input once, each rank well under all of it
(Pixtral: all of it on every rank).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.dist import _vlm_shard as S
from tests.dist._parity import GRAD_RTOL, LOSS_RTOL, grad_errors, loss_error

QWEN = ("qwen2_5_vl", "qwen3_vl")


def _runs(world_size: int) -> list[tuple[str, str, str, bool]]:
    backends = ("ulysses", "auto")
    runs = [(arch, b, name, False) for arch in (*QWEN, "internvl") for b in backends for name in S.cases(arch)]
    runs += [(arch, "ulysses", "video_and_image", True) for arch in QWEN]
    return runs + [("pixtral", b, "two_sizes", False) for b in backends]


def _check_rows(batch: dict, every: list[list[int]], whole: bool) -> None:
    """Every rank ran each tower call; a call with at least one item per rank is split, each item encoded once
    (with fewer items, ranks without one encode a stand-in item); a tower that is not cut (`whole`) got the whole
    input on every rank."""
    calls = list(zip(*every, strict=True))  # per tower call, every rank's rows
    expected = S.tower_calls(batch)
    assert len(calls) == len(expected) and all(min(call) > 0 for call in calls), every
    for call, (total, items) in zip(calls, expected, strict=True):
        assert sum(call) >= total, every
        if whole:
            assert set(call) == {total}, every
        elif items >= len(every):
            assert sum(call) == total and max(call) < total, every


def _compare(key, loss, grads, ref_loss, ref_grads) -> float:
    assert loss_error(loss, ref_loss) <= LOSS_RTOL, (key, loss, ref_loss)
    assert {n for n, g in grads.items() if g is None} == {n for n, g in ref_grads.items() if g is None}, key
    tower = [n for n in ref_grads if ".visual." in n or ".vision_tower." in n]
    frozen = key[-1]
    assert tower and all((ref_grads[n] is None) == frozen for n in tower), key
    if not frozen:  # the tower trained, and its gradients are among those compared
        assert any(float(ref_grads[n].abs().max()) > 0 for n in tower), key
    present = {n: g for n, g in grads.items() if g is not None}
    # CLIP-like key biases get an exactly-zero gradient (softmax ignores a shift on every key): scale by the largest.
    scale = max(float(g.abs().max()) for g in present.values())
    zero = {n for n in present if float(ref_grads[n].abs().max()) < 1e-6 * scale}
    errors = grad_errors(
        {n: present[n] for n in present if n not in zero}, {n: ref_grads[n] for n in present if n not in zero}
    )
    errors.update({n: float((present[n] - ref_grads[n]).abs().max()) / scale for n in zero})
    bad = {n: e for n, e in errors.items() if e > GRAD_RTOL}
    assert not bad, (key, bad)
    return max(errors.values())


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_tower_matches_single_process(world_size, record_property):
    runs = _runs(world_size)
    results = run_distributed(S.shard_worker, world_size, runs, timeout=420)[0]
    assert set(results) == set(runs)
    refs = {}
    worst = {}
    for key, (loss, grads, every) in results.items():
        arch, _, name, frozen = key
        batch = S.cases(arch)[name]
        if (arch, name, frozen) not in refs:
            refs[(arch, name, frozen)] = S.reference(arch, batch, frozen)
        worst["/".join(map(str, key))] = _compare(key, loss, grads, *refs[(arch, name, frozen)])
        _check_rows(batch, every, whole=arch == "pixtral")
    record_property("max_grad_rel", worst)


@pytest.mark.parametrize("arch", ["qwen3_vl"])
def test_sharded_tower_under_fsdp2(arch):
    """FSDP2 with the tower and its blocks as units: the rank without an image runs the tower on a stand-in
    (its parameter gathers match the other rank's; no hang within the timeout) and nothing changes."""
    loss, grads, rows = run_distributed(S.fsdp2_worker, 2, arch, "one_image", timeout=240)[0]
    ref_loss, ref_grads = S.reference(arch, S.cases(arch)["one_image"], False)
    _compare((arch, "fsdp2", "one_image", False), loss, grads, ref_loss, ref_grads)
    assert rows == [S.tower_calls(S.cases(arch)["one_image"])[0][0]]  # the image, or the stand-in


def refusal_worker(rank: int, world_size: int) -> list[str]:
    """Gemma 3 and Idefics3 under SP: refused, naming why, and nothing left installed."""
    import transformers

    import hf_longctx

    text = {"vocab_size": 160, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 8, "patch_size": 2}  # fmt: skip
    models = {
        "bidirectionally": transformers.Gemma3ForConditionalGeneration._from_config(
            transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4),
            attn_implementation="sdpa"),
        "no `language_model` decoder": transformers.Idefics3ForConditionalGeneration._from_config(
            transformers.Idefics3Config(text_config=transformers.LlamaConfig(**text), image_token_id=150,
                                        vision_config=transformers.Idefics3VisionConfig(**vision), scale_factor=2),
            attn_implementation="sdpa"),
    }  # fmt: skip
    groups, messages = hf_longctx.SequenceParallelGroups.build(world_size), []
    for why, model in models.items():
        with pytest.raises(ValueError, match=why) as err:
            hf_longctx.enable_sequence_parallel(model, groups)
        assert model.config.get_text_config()._attn_implementation == "sdpa"  # rolled back
        messages.append(str(err.value))
    return messages


def test_unsupported_families_refused_by_name():
    """Gemma 3's decoder attends bidirectionally within an image; Idefics3 / SmolVLM have no `language_model`:
    both refused under SP, naming the class and why."""
    for gemma, idefics in run_distributed(refusal_worker, 2, timeout=120):
        assert "Gemma3Model" in gemma and "Idefics3Model" in idefics, (gemma, idefics)


def test_single_process_tower_unchanged():
    """Without SP nothing is installed on the tower: it sees the whole input."""
    import hf_longctx

    model = S.build("qwen3_vl")
    batch = S.cases("qwen3_vl")["video_and_image"]
    with hf_longctx.enable_sequence_parallel(model, hf_longctx.SequenceParallelGroups.single()):
        rows, _ = S.record_tower_rows(model)
        with torch.no_grad():
            model(**{k: v for k, v in batch.items() if k != "labels"})
    assert sorted(rows) == sorted([16, 96])


@pytest.mark.slow
def test_sharded_tower_under_zero3_trainer(tmp_path):
    """The stock Trainer with DeepSpeed ZeRO-3 at SP=2: per-step loss and grad_norm equal the run without SP
    and without DeepSpeed (3 SGD steps), and each rank's tower encoded part of every batch's patches."""
    pytest.importorskip("deepspeed", reason="deepspeed is a dev dependency (pip install -e '.[dev]')")
    from tests.dist import _vlm as V
    from tests.dist._trainer_utils import compare_logs

    ref = run_distributed(V.trainer_worker, 1, str(tmp_path / "ref"), "qwen2_5_vl", {}, timeout=300)[0]
    runs = run_distributed(S.zero3_worker, 2, str(tmp_path / "sp"), "qwen2_5_vl", timeout=400)
    for result in runs:
        compare_logs(result["logs"], ref["logs"], ("loss", "grad_norm"), 1e-5)
    assert len(runs[0]["logs"]) == 3
    per_call = list(zip(*(r["tower_rows"] for r in runs), strict=True))  # per call, each rank's rows
    calls = runs[0]["calls"]
    assert len(per_call) == len(calls) and sum(rows for rows, _ in calls) == ref["tower_rows"], (per_call, calls)
    assert any(images == 1 for _, images in calls), calls  # a batch with one image: a rank encoded a stand-in
    for ranks, (rows, images) in zip(per_call, calls, strict=True):
        assert min(ranks) > 0 and sum(ranks) >= rows, (ranks, rows)
        if images >= 2:
            assert max(ranks) < rows, (ranks, rows)


def test_a_lone_tower_call_runs_whole_without_a_collective():
    """Only the model's forward (which every SP rank runs) is split: a rank calling `get_image_features` alone
    gets the plain model's features instead of waiting in the gather forever; training stays exact after it."""
    arch = "qwen2_5_vl"
    results = run_distributed(S.lone_call_worker, 2, arch, timeout=180)
    assert results[0][0], "rank 0's lone call differs from the plain model's features"
    ref_loss, ref_grads = S.reference(arch, S.cases(arch)["video_and_image"], False)
    for _, loss, grads in results:
        _compare((arch, "ulysses", "video_and_image", False), loss, grads, ref_loss, ref_grads)

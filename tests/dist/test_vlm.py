"""Vision-language models under SP are exact: Qwen2.5-VL and Qwen3-VL (DeepStack), SP=2 and SP=4 vs SP=1.

The vision tower runs sharded over the SP group (`hf_longctx/multimodal/vision_shard.py`), the features are
merged and the mRoPE positions computed on the full row, and the decoder runs on shards
(`hf_longctx/multimodal/vision.py`).
Compared with the plain model on the whole batch (no hf_longctx): the loss and every parameter's
gradient, vision tower included; images straddle the shard boundaries, two images share a row next to a
padded row with none, and one batch has no image at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_distributed
from tests.dist import _vlm as V
from tests.dist import _vlm_sft as S
from tests.dist._parity import GRAD_RTOL, LOSS_RTOL, grad_errors, loss_error
from tests.dist._trainer_utils import compare_logs

BACKENDS = {2: ("ulysses", "ring"), 4: ("ulysses",)}


def _reference(arch: str, batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    model = V.build(arch)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    shift = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), shift.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), V.all_grads(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_vlm_matches_single_process(world_size, record_property):
    results = run_distributed(V.cases_worker, world_size, V.ARCHS, BACKENDS[world_size], False, timeout=400)[0]
    refs = {(arch, name): _reference(arch, batch) for arch in V.ARCHS for name, batch in V.cases(arch).items()}
    assert len(results) == len(V.ARCHS) * len(BACKENDS[world_size]) * len(V.cases())
    worst = V.compare_cases(results, refs)
    for (arch, name), (_, ref_grads) in refs.items():
        vision = [k for k in ref_grads if ".visual." in k or k.startswith("model.visual")]
        assert vision, sorted(ref_grads)[:5]
        if name != "no_image":  # the vision tower really trains
            assert any(float(ref_grads[k].abs().max()) > 0 for k in vision), (arch, name)
    record_property("max_grad_rel", worst)


@pytest.mark.parametrize("world_size", [2, 4])
def test_llava_matches_single_process(world_size, record_property):
    """LLaVA-style (a CLIP tower, the placeholder expanded to one token per patch, 1-D positions): the same hooks.

    CLIP's key-projection biases get an exactly-zero gradient (a bias on every key shifts all logits of a
    query equally, which softmax ignores); the fp32 round-off left there (~1e-10) has no scale of its own,
    so those two are held to the largest gradient's scale instead.
    """
    results = run_distributed(V.cases_worker, world_size, ("llava",), BACKENDS[world_size], False, timeout=400)[0]
    worst: dict[str, float] = {}
    for (_, backend, name), (loss, grads) in results.items():
        ref_loss, ref_grads = _reference("llava", V.cases("llava")[name])
        assert loss_error(loss, ref_loss) <= LOSS_RTOL, (backend, name, loss, ref_loss)
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        zero = {k for k in ref_grads if k.endswith("self_attn.k_proj.bias") and ".vision_tower." in k}
        assert zero and all(float(ref_grads[k].abs().max()) < 1e-6 * scale for k in zero)
        errors = grad_errors(
            {k: grads[k] for k in grads if k not in zero}, {k: ref_grads[k] for k in grads if k not in zero}
        )
        errors.update({k: float((grads[k] - ref_grads[k]).abs().max()) / scale for k in zero})
        bad = {k: v for k, v in errors.items() if v > GRAD_RTOL}
        assert not bad, (backend, name, bad)
        if name != "no_image":
            assert any(V.vision_parameter(k) and float(ref_grads[k].abs().max()) > 0 for k in ref_grads)
        worst[f"{backend}/{name}"] = max(errors.values())
    assert len(results) == len(BACKENDS[world_size]) * len(V.llava_cases())
    record_property("max_grad_rel", worst)


def _compare_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Every parameter's gradient within GRAD_RTOL of its own scale; the vision tower's among them."""
    errors = grad_errors(got, want)
    bad = {k: v for k, v in errors.items() if v > GRAD_RTOL}
    assert not bad, bad
    assert any(".visual." in k and float(v.abs().max()) > 0 for k, v in want.items())  # the vision tower trained
    return max(errors.values())


def _steps_match(worker, tmp_path, arch: str, *args) -> dict[str, float]:
    """`worker` in one process and at SP=2: per-step loss and grad_norm, and every first-step gradient."""
    ref = run_distributed(worker, 1, str(tmp_path / "ref"), arch, *args, timeout=300)[0]
    runs = run_distributed(worker, 2, str(tmp_path / "sp"), arch, *args, timeout=300)
    worst = {}
    for result in runs:
        assert result["attn"].startswith("hf_longctx_"), result["attn"]
        worst.update(compare_logs(result["logs"], ref["logs"], ("loss", "grad_norm"), 1e-5))
        worst["first_grads"] = _compare_grads(result["first_grads"], ref["first_grads"])
    assert len(ref["logs"]) == 3 and set(worst) == {"loss", "grad_norm", "first_grads"}
    # The vision tower ran sharded: each rank encoded part of the patches, together all of them (+ stand-ins).
    rows = [result["tower_rows"] for result in runs]
    assert max(rows) < ref["tower_rows"] <= sum(rows), (rows, ref["tower_rows"])
    return worst


@pytest.mark.parametrize("arch", V.ARCHS)
def test_vlm_trainer_steps_match(arch, tmp_path, record_property):
    """The stock Trainer with a VLM collator: per-step loss and grad_norm at SP=2 equal one process's, and
    every parameter's gradient (after DDP) in the first step."""
    record_property("max_rel_diff", _steps_match(V.trainer_worker, tmp_path, arch, {}))


@pytest.mark.parametrize("arch", V.ARCHS)
def test_vlm_sft_trainer_steps_match(arch, tmp_path, record_property):
    """TRL's SFTTrainer on a vision dataset (PIL images through the model's processor and TRL's vision
    collator): per-step loss and grad_norm at SP=2 equal one process's, and every first-step gradient."""
    record_property("max_rel_diff", _steps_match(S.sft_worker, tmp_path, arch))

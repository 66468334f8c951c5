"""TRL `DistillationTrainer` under hf_longctx SP against the same computation without SP (TRL's own code).

- Function level (`_distill_jobs.loss_job`), SP=2 (and SP=4, slow): for every divergence (forward KL, JSD at two
  betas, reverse KL) at two temperatures, through TRL's kernel and hf_longctx's tiles, one training
  `compute_loss` + backward on fixed rows (a row scored on one SP rank only, one on the other, rows across the
  boundary, a multi-turn tool mask): the mean loss over ranks, the entropy metric, every student gradient after
  the DDP average, and the evaluation loss; again for LoRA adapters under ring attention (`LORA_RING`).
- `train()` (`_distill_jobs.RUNS`), SP=2: per step, loss, grad_norm and every other logged metric within 1e-5,
  the same prompts and completions at every generation, then `evaluate()`'s metrics; with DP=2 x SP=2 and
  ZeRO-3 (slow) against DP=2.
- Generation: SP ranks sampling different tokens raise on every rank; `use_vllm=True` is refused by name.

The teacher is a tiny Gemma-2, wider than the student, with logit soft-capping.
"""

from __future__ import annotations

import pytest

from hf_longctx.attention.registry import KEY_PREFIX
from tests.dist import _distill_jobs as J
from tests.dist import _trainer_utils as U

RTOL = 1e-5
GRAD_RTOL = 1e-4  # DESIGN.md: float32 gradients, relative to each parameter's largest entry
TIMEOUT_S = {1: 300, 2: 400, 4: 600}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("distill")


def _spawn(
    out_root, world: int, loss: bool, run_sp: int, names: list[str], checks: bool = False, whole: tuple[str, ...] = ()
) -> list[dict]:
    path = str(out_root / f"w{world}_sp{run_sp}")
    key = ("distill", world, loss, run_sp, tuple(names), checks, whole)
    return U.spawn_once(key, J.worker, world, path, loss, run_sp, names, checks, whole, timeout=TIMEOUT_S[world])


def _reference(out_root) -> dict:
    return _spawn(out_root, 1, True, 1, list(J.RUNS))[0]


def _assert_same_losses(ranks: list[dict], ref: dict, job: str = "loss") -> dict[str, float]:
    """Every case of the SP ranks' loss `job` against the reference's (TRL's kernel); returns the worst rel diffs."""
    worst: dict[str, float] = {}

    def check(name: str, got: float, want: float, rtol: float) -> None:
        diff = U.rel_diff(got, want)
        assert diff <= rtol, (name, got, want, diff)
        worst[name] = max(worst.get(name, 0.0), diff)

    cases = [key for key in ranks[0][job] if key != "shards"]
    settings = J.SETTINGS if job == "loss" else J.LORA_RING_SETTINGS
    assert len(cases) == 2 * len(settings)  # TRL's kernel and hf_longctx's tiles
    for beta, temperature, tiled in cases:
        want = ref[job][(beta, temperature, False)]
        got = [rank[job][(beta, temperature, tiled)] for rank in ranks]
        # Each rank's loss is its shard's share: their mean is the loss without SP (the logged loss).
        check("loss", sum(r["loss"] for r in got) / len(got), want["loss"], RTOL)
        for rank in got:
            check("entropy", rank["entropy"], want["entropy"], RTOL)
            check("eval_loss", rank["eval_loss"], want["eval_loss"], RTOL)
            check("eval_entropy", rank["eval_entropy"], want["eval_entropy"], RTOL)
            assert rank["grads"].keys() == want["grads"].keys()
            for name, grad in want["grads"].items():
                scale = grad.abs().max().item()
                assert scale > 0, name  # not vacuous: every parameter has a gradient
                diff = (rank["grads"][name] - grad).abs().max().item() / scale
                assert diff <= GRAD_RTOL, (beta, temperature, tiled, name, diff)
                worst["grads"] = max(worst.get("grads", 0.0), diff)
    # The settings differ: each case computes its own divergence.
    assert len({ref[job][(b, t, False)]["loss"] for b, t in settings}) == len(settings)
    return worst


def _assert_shard_coverage(ranks: list[dict], counts_key) -> None:
    """Among the rows the SP ranks scored: one held by one rank only and one across a shard boundary."""
    per_call = list(zip(*(counts_key(rank) for rank in ranks), strict=True))
    assert per_call
    kinds = set()
    for call in per_call:
        for row in zip(*call, strict=True):
            holders = sum(1 for n in row if n > 0)
            kinds.add("one rank" if holders == 1 else "across" if holders > 1 else "none")
    assert {"one rank", "across"} <= kinds, kinds


@pytest.mark.parametrize("job", ["loss", "loss_lora_ring"])
def test_loss_and_gradients_sp2_match_without_sp(job: str, out_root, record_property) -> None:
    ref = _reference(out_root)
    ranks = _spawn(out_root, 2, True, 2, list(J.RUNS), checks=True)
    _assert_shard_coverage(ranks, lambda rank: rank["loss"]["shards"])  # contiguous shards (ring: zigzag)
    record_property("max_rel_diff", _assert_same_losses(ranks, ref, job))


def _assert_same_run(got: dict, want: dict) -> dict[str, float]:
    """The same prompts and completions at every generation, every step's metrics and the eval metrics within
    RTOL; returns the worst rel diff per metric."""
    assert "error" not in want, want["error"]
    assert "error" not in got, got["error"]
    assert len(got["generations"]) == len(want["generations"]) > 0
    for index, (mine, ref) in enumerate(zip(got["generations"], want["generations"], strict=True)):
        assert mine[0] == ref[0], f"generation {index} is for other prompts"
        assert mine[1] == ref[1], f"generation {index} sampled other completions"
    assert got["tables"] == want["tables"]  # TRL's completion log: the latest generation's prompts and completions
    assert len(got["steps"]) == len(want["steps"]) == J.STEPS
    worst: dict[str, float] = {}
    for mine, ref in [*zip(got["steps"], want["steps"], strict=True), (got["eval"], want["eval"])]:
        assert mine.keys() == ref.keys(), (sorted(mine), sorted(ref))
        for key, value in ref.items():
            diff = U.rel_diff(mine[key], value)
            assert diff <= RTOL, (ref.get("step", "eval"), key, mine[key], value)
            worst[key] = max(worst.get(key, 0.0), diff)
    return worst


@pytest.mark.parametrize("run", list(J.RUNS))
def test_sp2_train_matches_without_sp(run: str, out_root, record_property) -> None:
    ref = _reference(out_root)[run]
    # Not vacuous: the student is trained, completions end at different lengths, evaluation ran.
    assert all(step["grad_norm"] > 0 for step in ref["steps"])
    assert any(0 < step["completions/clipped_ratio"] < 1 for step in ref["steps"]), ref["steps"]
    assert not J.RUNS[run].get("evaluate") or "eval_loss" in ref["eval"]
    ranks = _spawn(out_root, 2, True, 2, list(J.RUNS), checks=True)
    worst: dict[str, float] = {}
    for rank in ranks:
        result = rank[run]
        assert "error" not in result, result["error"]
        assert all(attn.startswith(f"{KEY_PREFIX}_ulysses_") for attn in result["attn"]), result["attn"]
        assert result["restored"]  # after detach(): no instance patch left, TRL's gather_object is accelerate's
        for key, diff in _assert_same_run(result, ref).items():
            worst[key] = max(worst.get(key, 0.0), diff)
    _assert_shard_coverage(ranks, lambda rank: rank[run]["shards"])
    record_property("max_rel_diff", worst)


def test_generation_checks_and_refusals(out_root) -> None:
    for rank in _spawn(out_root, 2, True, 2, list(J.RUNS), checks=True):
        messages = rank["generation"]
        assert messages["diverged"] and "generated different completions" in messages["diverged"]
        assert messages["use_vllm"] and messages["use_vllm"].startswith(
            "DistillationTrainer is not supported with hf_longctx sequence parallelism: use_vllm=True"
        )
        assert "set use_vllm=False" in messages["use_vllm"]


@pytest.mark.slow
def test_sp4_loss_and_dp2_sp2_zero3_train(out_root, record_property) -> None:
    """One 4-process spawn: the loss job at SP=4 (shards of 4 tokens: rows over 1 to 3 ranks) and the `RUNS` at SP=4
    against one process, then DP=2 x SP=2 with ZeRO-3 (student and teacher) and accumulation 2 against DP=2 on 2
    processes: each SP group trains like the DP rank it stands for."""
    names = list(J.DP_RUNS)
    ranks = _spawn(out_root, 4, True, 2, names, whole=tuple(J.RUNS))
    worst = {}
    for job in ("loss", "loss_lora_ring"):
        worst[job] = _assert_same_losses(ranks, _reference(out_root), job)
    _assert_shard_coverage(ranks, lambda rank: rank["loss"]["shards"])
    for run in J.RUNS:
        for rank in ranks:
            result = rank[f"{run}@sp4"]
            assert "error" not in result, result["error"]
            for key, diff in _assert_same_run(result, _reference(out_root)[run]).items():
                worst[f"{run}@sp4"] = {
                    **worst.get(f"{run}@sp4", {}),
                    key: max(worst.get(f"{run}@sp4", {}).get(key, 0.0), diff),
                }
    ref = _spawn(out_root, 2, False, 1, names)
    for name in names:
        # The two DP ranks sample with different RNG streams: different completions.
        assert ref[0][name]["generations"] != ref[1][name]["generations"]
        for world_rank, rank in enumerate(ranks):
            for key, diff in _assert_same_run(rank[name], ref[world_rank // 2][name]).items():
                worst[name] = {**worst.get(name, {}), key: max(worst.get(name, {}).get(key, 0.0), diff)}
        _assert_shard_coverage(ranks[:2], lambda rank, name=name: rank[name]["shards"])
    record_property("max_rel_diff", worst)

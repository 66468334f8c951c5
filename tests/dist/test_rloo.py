"""TRL `RLOOTrainer` under SP against the same computation without SP.

Function level (`_rloo_jobs.loss_job`): on fixed completions (rows whose completion straddles every shard boundary,
rows that lie in SP rank 0's shard while the other ranks hold only padding, a fully masked completion) and
off-policy old log-probs, one `_compute_loss` + backward per clipping variant gives the same loss, grad_norm, every
parameter's gradient and every metric it logs (entropy, clip ratios; `aux_loss` for a Qwen3-MoE), at SP=2 (Ulysses
and ring) and SP=4.

Real `train()` (TRL's own sampling, `_grpo_train_jobs.runs_job`): SP=2 with gradient accumulation 2, 2 iterations per
generation, a reference model (beta > 0), normalised advantages and three weighted, clipped rewards (one a sequence
classifier); SP=2 with LoRA (reference = adapter disabled), then `evaluate()`; DP=2 x SP=2 under ZeRO-3 against
DP=2 under ZeRO-3; the first run again at SP=4. Every logged metric per step within 1e-5, every generation for the
same prompts with the same completions, the same completion tables. Before hf_longctx's RLOO path, `RLOOConfig`
refused `sp_size > 1` and `RLOOTrainer` was refused.
"""

from __future__ import annotations

import pytest

from hf_longctx.attention.registry import KEY_PREFIX
from tests.dist import _grpo_train_jobs as T
from tests.dist import _rloo_jobs as J
from tests.dist import _trainer_utils as U

RTOL = 1e-5
TIMEOUT_S = {1: 300, 2: 500, 4: 600}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("rloo")


def _reference(out_root) -> dict:
    return U.spawn_once(("rloo", 1), J.reference_job, 1, str(out_root / "w1"), timeout=TIMEOUT_S[1])[0]


def _sp2(out_root) -> list[dict]:
    return U.spawn_once(("rloo", 2), J.sp_job, 2, str(out_root / "w2"), timeout=TIMEOUT_S[2])


def _assert_same_loss(got: dict, want: dict, worst: dict[str, float]) -> None:
    """Loss, grad_norm, every gradient (relative to its largest entry) and every logged metric within RTOL; the
    differences go into `worst`."""
    diffs = {
        "loss": U.rel_diff(got["loss"], want["loss"]),
        "grad_norm": U.rel_diff(got["grad_norm"], want["grad_norm"]),
    }
    assert got["grads"].keys() == want["grads"].keys()
    diffs["grads"] = max(
        ((got["grads"][name] - ref).abs().max() / ref.abs().max()).item() for name, ref in want["grads"].items()
    )
    assert got["metrics"].keys() == want["metrics"].keys()
    for key, ref in want["metrics"].items():
        diffs[key] = abs(got["metrics"][key] - ref) / max(abs(ref), 1e-6)
    for key, diff in diffs.items():
        assert diff <= RTOL, (key, diff)
        worst[key] = max(worst.get(key, 0.0), diff)


# SP-side pass -> (its reference without SP, its backend).
PASSES = {"loss": ("loss", "ulysses"), "loss_moe": ("loss_moe", "ulysses"), "loss_ring": ("loss", "ring")}


@pytest.mark.parametrize("run", list(PASSES))
@pytest.mark.parametrize("variant", list(J.VARIANTS))
def test_loss_and_grads_match_without_sp(variant: str, run: str, out_root, record_property) -> None:
    ref_key, backend = PASSES[run]
    ref = _reference(out_root)[ref_key][variant]
    # Not vacuous: some rows are clipped (low and high), others are not, and every metric is logged.
    assert 0 < ref["metrics"]["clip_ratio/region_mean"] < 1, ref["metrics"]
    assert ref["grad_norm"] > 0 and ("aux_loss" in ref["metrics"]) == (run == "loss_moe")
    worst: dict[str, float] = {}
    for rank in _sp2(out_root):
        assert rank[run]["attn"].startswith(f"{KEY_PREFIX}_{backend}_"), rank[run]["attn"]
        _assert_same_loss(rank[run][variant], ref, worst)
    record_property("max_rel_diff", worst)


@pytest.mark.parametrize("run", list(J.RUNS))
def test_sp2_run_matches_without_sp(run: str, out_root, record_property) -> None:
    ref = _reference(out_root)["runs"][run]
    assert "error" not in ref, ref["error"]
    # Not vacuous: a gradient at every step, a KL term, and short rows (one EOS token) in every generation.
    assert all(step["grad_norm"] > 0 for step in ref["steps"])
    assert ref["eval"] is None or abs(ref["eval"]["eval_kl"]) > 0
    assert any(step.get("kl", 0) != 0 for step in ref["steps"])
    assert all(min(len(c) for c in completions) == 1 for _, completions in ref["generations"])
    worst: dict[str, float] = {}
    for rank in _sp2(out_root):
        got = rank["runs"][run]
        assert "error" not in got, got["error"]
        assert got["attn"].startswith(f"{KEY_PREFIX}_ulysses_"), got["attn"]
        assert got["restored"]  # after detach(): no instance patch left, TRL's gathers are accelerate's
        for key, diff in T.assert_same_run(got, ref, J.FLOORS).items():
            worst[key] = max(worst.get(key, 0.0), diff)
    record_property("max_rel_diff", worst)


def test_combined_run_clips_and_uses_every_reward(out_root) -> None:
    """The settings of the `combined` run take effect (else its comparison would not cover them)."""
    steps = _reference(out_root)["runs"]["combined"]["steps"]
    assert any(0 < step["clip_ratio/region_mean"] < 1 for step in steps)  # the second iteration is off-policy
    assert sum("rewards/" in key and key.endswith("/mean") for key in steps[0]) == 3


@pytest.mark.parametrize(
    "setup, names",
    [
        # An RLOOConfig built without SP and given parallelism_config afterwards counted both processes as DP ranks.
        ("sized_by_every_process", ("generation_batch_size=4", "rloo_config")),
        ("continuous_batching", ("RLOOTrainer", "use_transformers_continuous_batching=False")),
    ],
)
def test_setups_without_an_exact_path_are_refused_while_the_trainer_is_built(setup, names, out_root) -> None:
    for rank in _sp2(out_root):
        message = rank["refusals"][setup]
        assert message is not None and all(name in message for name in names), message


@pytest.mark.slow
def test_dp2_sp2_zero3_run_and_sp4_loss_match_without_sp(out_root, record_property) -> None:
    """4 processes: the loss passes and the `combined` run at SP=4 (DDP) against 1 process, then DP=2 x SP=2 under
    ZeRO-3 against DP=2 under ZeRO-3 (2 processes): each SP group trains like the DP rank it stands for."""
    ref = U.spawn_once(("rloo_dp", 2), J.dp_job, 2, str(out_root / "dp2"), 1, timeout=TIMEOUT_S[2])
    ranks = U.spawn_once(("rloo_dp", 4), J.dp_job, 4, str(out_root / "dp2sp2"), 2, timeout=TIMEOUT_S[4])
    want = _reference(out_root)["loss"]
    worst_sp4: dict[str, float] = {}
    for rank in ranks:
        assert rank["loss"]["attn"].startswith(f"{KEY_PREFIX}_ulysses_"), rank["loss"]["attn"]
        for variant in J.VARIANTS:
            _assert_same_loss(rank["loss"][variant], want[variant], worst_sp4)
    for rank in ranks:
        for key, diff in T.assert_same_run(
            rank["sp4"]["combined"], _reference(out_root)["runs"]["combined"], J.FLOORS
        ).items():
            worst_sp4[key] = max(worst_sp4.get(key, 0.0), diff)
    record_property("sp4_max_rel_diff", worst_sp4)
    worst: dict[str, float] = {}
    for name in J.DP_RUNS:
        # The two DP ranks generate for the same prompt with different RNG streams: different completions.
        assert ref[0]["runs"][name]["generations"] != ref[1]["runs"][name]["generations"]
        for world_rank, rank in enumerate(ranks):
            assert rank["runs"][name]["attn"].startswith(f"{KEY_PREFIX}_ulysses_"), rank["runs"][name]
            assert rank["runs"][name]["restored"]
            for key, diff in T.assert_same_run(
                rank["runs"][name], ref[world_rank // 2]["runs"][name], J.FLOORS
            ).items():
                worst[key] = max(worst.get(key, 0.0), diff)
    record_property("max_rel_diff", worst)

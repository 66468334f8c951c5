"""TRL `GRPOTrainer` at SP=2 against one process without SP.

With fixed completions (left-padded prompts, right-padded completions, off-policy old log-probs), one
`_compute_loss` + backward per supported `loss_type` gives the same loss, grad_norm and every parameter's
gradient (after DDP's average over both ranks), with Ulysses, with ring attention (zigzag shards), and
for LoRA adapters under ring. A real 2-step `train()` generating with transformers on CPU finishes with a
toy reward; with prompt-seeded sampling, a reference model (beta > 0) and a varying reward, its per-step
metrics and a following `evaluate()` equal the run without SP. SP ranks that generate different
completions raise instead of hanging, and setups without an exact path (a config whose generation sizes count SP
ranks as DP ranks, a `rollout_func`) are refused while the trainer is built. The configurations RL runs use
(accumulation, iterations, DP x SP, ...) are in `test_grpo_train.py`.
"""

from __future__ import annotations

import pytest

from hf_longctx.attention.registry import KEY_PREFIX
from tests.dist import _grpo_jobs as J
from tests.dist import _trainer_utils as U

RTOL = 1e-5
SPAWN_TIMEOUT_S = {1: 300, 2: 500}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("grpo")


def _reference(out_root) -> dict:
    return U.spawn_once(("grpo", 1), J.reference_job, 1, str(out_root / "w1"), timeout=SPAWN_TIMEOUT_S[1])[0]


def _sp(out_root) -> list[dict]:
    return U.spawn_once(("grpo", 2), J.sp_job, 2, str(out_root / "w2"), timeout=SPAWN_TIMEOUT_S[2])


# SP-side run -> (its key in sp_job's result, its backend, its reference in reference_job's result).
RUNS = {
    "ulysses": ("loss", "ulysses", None),
    "ring": ("loss_ring", "ring", None),
    # LoRA on every linear layer (only the adapters train), ring attention.
    "lora_ring": ("loss_lora_ring", "ring", "lora"),
}


@pytest.mark.parametrize("run", list(RUNS))
@pytest.mark.parametrize("loss_type, level", J.LOSS_TYPES, ids=[f"{t}-{lv}" for t, lv in J.LOSS_TYPES])
def test_loss_and_grads_match_without_sp(loss_type: str, level: str, run: str, out_root) -> None:
    key, backend, ref_key = RUNS[run]
    ref = _reference(out_root)
    ref = (ref[ref_key] if ref_key else ref)[f"{loss_type}/{level}"]
    for rank in _sp(out_root):
        # The policy forward really ran sharded, with this backend.
        assert rank[key]["attn"].startswith(f"{KEY_PREFIX}_{backend}_"), rank[key]["attn"]
        got = rank[key][f"{loss_type}/{level}"]
        assert U.rel_diff(got["loss"], ref["loss"]) <= RTOL, (got["loss"], ref["loss"])
        assert U.rel_diff(got["grad_norm"], ref["grad_norm"]) <= RTOL, (got["grad_norm"], ref["grad_norm"])
        assert got["grads"].keys() == ref["grads"].keys()
        for name, want in ref["grads"].items():
            err = ((got["grads"][name] - want).abs().max() / want.abs().max()).item()
            assert err <= RTOL, (name, err)


def test_train_two_steps_at_sp2(out_root) -> None:
    ranks = _sp(out_root)
    for rank in ranks:
        assert rank["train"]["global_step"] == 2
        assert len(rank["train"]["logs"]) == 2
    assert ranks[0]["train"]["logs"] == ranks[1]["train"]["logs"]  # the SP ranks train one model


def test_train_then_evaluate_match_without_sp(out_root, record_property) -> None:
    """A real train() of 2 steps, then evaluate(): per-step loss, grad_norm, reward, KL and the eval loss,
    reward, KL equal the run without SP (completions fixed by prompt-seeded sampling)."""
    ref = _reference(out_root)["eval_run"]
    # Not a vacuous comparison: the policy moved away from the reference and the eval loss is not zero.
    assert ref["eval"]["kl"] > 0 and abs(ref["eval"]["loss"]) > 1e-3 and ref["train"][0]["grad_norm"] > 0
    worst: dict[str, float] = {}
    for rank in _sp(out_root):
        got = rank["eval_run"]
        runs = [*zip(got["train"], ref["train"], strict=True), (got["eval"], ref["eval"])]
        for step, (mine, want) in enumerate(runs):
            for key, value in want.items():
                # The first step is on-policy: its loss is a mean of advantages that sum to 0 (float noise).
                diff = abs(mine[key] - value) / max(abs(value), 1e-2 if key == "loss" else 1e-30)
                assert diff <= RTOL, (step, key, mine[key], value)
                worst[key] = max(worst.get(key, 0.0), diff)
    record_property("max_rel_diff", worst)


def test_diverging_generation_raises(out_root) -> None:
    for rank in _sp(out_root):
        assert rank["diverge"] is not None and "generated different completions" in rank["diverge"]


@pytest.mark.parametrize(
    "setup, names",
    [
        # A GRPOConfig parsed without SP and given parallelism_config afterwards counted both processes as DP ranks.
        ("sized_by_every_process", ("generation_batch_size=4", "grpo_config")),
        ("rollout_func", ("rollout_func=None",)),
    ],
)
def test_setups_without_an_exact_path_are_refused_while_the_trainer_is_built(setup, names, out_root) -> None:
    for rank in _sp(out_root):
        message = rank["refusals"][setup]
        assert message is not None and all(name in message for name in names), message

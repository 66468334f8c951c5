"""TRL `DPOTrainer` under hf_longctx SP is exact: SP=2 against one process without SP, per step.

The SP run computes each row's summed log-probability on its shard and adds it over the SP group before the
loss; the run without SP is TRL's own code. Compared per step: loss, grad_norm, the rewards/logps metrics and
TRL's per-token metrics; the evaluation metrics; and every trained weight after the run (SGD, no clipping:
equal weights mean equal per-parameter gradients at every step). The pairs' chosen and rejected lengths differ
and the padded batches have odd lengths (not divisible by sp), so completions straddle the shard boundary.
"""

from __future__ import annotations

import pytest

from tests.dist import _dpo_jobs as J
from tests.dist import _trainer_utils as U

RTOL = 1e-5
# A reward is beta * (policy - reference log-prob), a difference of two sums of O(100) per-token terms: its
# rounding error scales with those sums, not with the (often small) reward. Rewards and margins are compared
# within RTOL of beta * |logps| (the log-probs themselves, and the loss, are compared at RTOL of their own size).
REWARD_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins")
# `logits/*` is the mean over the vocabulary of the logits, near 0 by the symmetry of a random init (4e-5 for the
# 9-head model), while its rounding error scales with the logits themselves (O(0.1) here: unit-RMS hidden states,
# init std 0.02): compared within RTOL of max(|value|, LOGIT_FLOOR), i.e. at most 1e-7 absolute (a 1e-3 floor
# failed on a CI machine at 4.2e-8, after three optimizer steps whose grad norms agreed to 3e-6).
LOGIT_KEYS, LOGIT_FLOOR = ("logits/chosen", "logits/rejected"), 1e-2
SPAWN_TIMEOUT_S = {1: 300, 2: 400}
CONFIGS = {
    # A separate reference model (other weights), sigmoid loss, evaluated at the end.
    "ref_model": {"evaluate": True},
    # LoRA through peft_config: the reference is the policy with its adapter disabled (no copy); the LM head's
    # log-probs in token tiles (the run without SP: TRL's own head); the Jensen-Shannon f-divergence.
    "peft": {"reference": "peft", "sp_options": {"tiled_loss": True}, "f_divergence_type": "js_divergence"},
    # Every other loss type at once (weighted), with gradient accumulation, on SmolLM2's 9-query / 3-kv-head
    # layout with sp_backend="auto" (Ulysses cannot split 9 heads over 2 ranks: auto picks the ring).
    "losses": {
        "shape": {"num_heads": 9, "num_kv_heads": 3, "hidden": 72},
        "sp_options": {"sp_backend": "auto"},
        "loss_type": list(J.MIXED_LOSSES),
        "loss_weights": list(J.MIXED_LOSSES.values()),
        "label_smoothing": 0.1,
        "gradient_accumulation_steps": 2,
        "steps": 2,
    },
    # LoRA with the reference log-probs precomputed by TRL (adapter disabled) before training, on shards too;
    # WPO weighting and the alpha f-divergence.
    "precompute": {
        "reference": "precompute",
        "steps": 2,
        "use_weighting": True,
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.5,
        "loss_type": ["sigmoid", "ipo"],
    },
    # A Qwen3-MoE policy and reference with the router loss on (coefficient 0.3): TRL adds it to the DPO loss.
    "moe": {"arch": "moe:qwen3_moe", "steps": 3},
    # DeepSpeed ZeRO-3: TRL prepares the reference model itself (not through accelerate's prepare), so SP reaches
    # it at its first forward; the forward-KL f-divergence. Last: it leaves accelerate's state set for DeepSpeed.
    "zero3": {"zero": 3, "steps": 2, "f_divergence_type": "forward_kl"},
}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("dpo")


def _world(world_size: int, out_root) -> list[dict]:
    configs = {name: {**c, "sp": world_size} for name, c in CONFIGS.items()}
    if world_size == 1:
        configs = {name: {k: v for k, v in c.items() if k != "sp_options"} for name, c in configs.items()}
    return U.spawn_once(
        ("dpo", world_size),
        J.dpo_worker,
        world_size,
        str(out_root / f"world{world_size}"),
        configs,
        timeout=SPAWN_TIMEOUT_S[world_size],
    )


def _check_rewards(got: dict, want: dict) -> float:
    """Assert the reward metrics agree within RTOL of beta * |logps|; return the largest absolute difference."""
    scale = J.BETA * max(abs(want["logps/chosen"]), abs(want["logps/rejected"]))
    diffs = {key: abs(got[key] - want[key]) for key in REWARD_KEYS}
    assert all(d <= RTOL * max(scale, abs(want[k])) for k, d in diffs.items()), (diffs, scale, got, want)
    return max(diffs.values())


def _check_logits(got: dict, want: dict) -> float:
    """Assert `logits/*` agree within RTOL of max(|value|, LOGIT_FLOOR); return the largest absolute difference."""
    diffs = {key: abs(got[key] - want[key]) for key in LOGIT_KEYS}
    assert all(d <= RTOL * max(abs(want[k]), LOGIT_FLOOR) for k, d in diffs.items()), (diffs, got, want)
    return max(diffs.values())


def _compare_eval(got: dict, want: dict) -> None:
    """`trainer.evaluate()`'s metrics: the same keys, every value as the training metrics are compared."""
    assert sorted(got) == sorted(want)
    metrics = [k for k in want if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))]
    if not metrics:
        return
    strip = {k.removeprefix("eval_"): k for k in metrics}
    mine, theirs = ({name: values[key] for name, key in strip.items()} for values in (got, want))
    _check_rewards(mine, theirs)
    _check_logits(mine, theirs)
    for name in strip:
        if name not in REWARD_KEYS + LOGIT_KEYS:
            assert U.rel_diff(mine[name], theirs[name]) <= RTOL, (name, mine[name], theirs[name])


def test_pairs_differ_in_length():
    rows = J.dpo_rows(16)
    assert sum(len(r["chosen"].split()) != len(r["rejected"].split()) for r in rows) >= 12


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dpo_sp2_matches_single_process(name, out_root, record_property):
    ref = _world(1, out_root)[0][name]
    assert ref["attn"] == "sdpa"
    worst = {}
    # Batches of odd length: the SP padding, and a completion split over both shards.
    assert any(n % 2 for n in ref["lengths"]), ref["lengths"]
    for rank_results in _world(2, out_root):
        result = rank_results[name]
        assert result["lengths"] == ref["lengths"]
        # Detaching restores the trainer: TRL's own methods and collator (the no-SP run never had a patch).
        assert result["undone"] == {"patched": sorted(J.PATCHED), "left": [], "collator": "DataCollatorForPreference"}
        assert ref["undone"]["patched"] == []
        assert result["attn"].startswith("hf_longctx_"), result["attn"]
        if CONFIGS[name].get("sp_options", {}).get("sp_backend") == "auto":
            assert result["attn"].startswith("hf_longctx_ring"), result["attn"]
        if "zero" not in CONFIGS[name]:  # ZeRO-3 hooks every module: the flag check reads lm_head's hooks
            tiled = CONFIGS[name].get("sp_options", {}).get("tiled_loss", False)
            assert result["flags"]["tiled_loss"] == tiled and not ref["flags"]["tiled_loss"]
        strict = tuple(k for k in J.DPO_KEYS if k not in REWARD_KEYS + LOGIT_KEYS)
        worst.update(U.compare_logs(result["logs"], ref["logs"], strict, RTOL))
        for got, want in zip(result["logs"], ref["logs"], strict=True):
            worst["rewards_abs"] = max(worst.get("rewards_abs", 0.0), _check_rewards(got, want))
            worst["logits_abs"] = max(worst.get("logits_abs", 0.0), _check_logits(got, want))
        _compare_eval(result["eval"], ref["eval"])
        assert sorted(result["weights"]) == sorted(ref["weights"])
        for param, want in ref["weights"].items():
            diff = float((result["weights"][param] - want).abs().max() / want.abs().max())
            assert diff <= RTOL, f"{param}: rel {diff:.2e}"
            worst["weights"] = max(worst.get("weights", 0.0), diff)
    assert {"loss", "grad_norm", "rewards_abs", "logps/chosen", "entropy"} <= set(worst)
    assert ("aux_loss" in worst) == ("arch" in CONFIGS[name])  # the router loss was compared, where it is on
    if name == "ref_model":
        assert "eval_loss" in ref["eval"] and "eval_rewards/chosen" in ref["eval"]
    record_property("max_rel_diff", worst)


def test_refused_option_is_named_at_construction(out_root):
    for rank_results in _world(2, out_root):
        message = rank_results["refused"]
        assert message is not None, "DPOTrainer(ld_alpha=0.5) was constructed under SP=2"
        assert message.startswith("DPOTrainer is not supported with hf_longctx sequence parallelism"), message
        assert "ld_alpha" in message and "ld_alpha=None" in message, message

"""TRL `RewardTrainer` under hf_longctx SP is exact: SP=2 against one process without SP, per step.

Each pair's score is read at its last real token: the chosen rows end on SP rank 1 and the rejected rows on
rank 0 (contiguous layout), and on either half of the zigzag layout (ring). Compared per step: loss, grad_norm,
accuracy, margin, min/mean/max reward, num_tokens; and every trained weight after the run (SGD, no clipping:
equal weights mean equal per-parameter gradients at every step). Then `trainer.evaluate()`: eval loss,
accuracy and rewards.
"""

from __future__ import annotations

import pytest

from tests.dist import _trainer_utils as U
from tests.dist import _trl_jobs as J

RTOL = 1e-5
SPAWN_TIMEOUT_S = {1: 300, 2: 400}
# A reward is the score head's dot product of a unit-RMS hidden state with its weights (init std 0.02, hidden 64):
# O(0.1), and its float32 rounding scales with that, not with a reward that happens to be near 0 (the ring run's
# min_reward, -0.0326, differed by 4.5e-7 = 1.4e-5 of itself on this machine, on f1bc042 as now). Rewards are
# compared within RTOL of max(|value|, REWARD_FLOOR); every trained weight stays within RTOL of its own size.
REWARD_FLOOR = 0.1
SCORES = ("mean_reward", "min_reward", "max_reward")
RELATIVE = tuple(k for k in J.REWARD_KEYS if k != "margin" and k not in SCORES)
# Every run ends with `trainer.evaluate()` on 5 held-out pairs (batches of 2: a partial last batch).
CONFIGS = {
    "ulysses": {"eval_rows": 5},
    "ring": {"sp_options": {"sp_backend": "ring"}, "eval_rows": 5},
    "lora": {"peft": True, "eval_rows": 5},
}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("reward")


def _world(world_size: int, out_root) -> list[dict]:
    configs = {name: {**c, "sp": world_size} for name, c in CONFIGS.items()}
    if world_size == 1:
        configs = {name: {k: v for k, v in c.items() if k != "sp_options"} for name, c in configs.items()}
    return U.spawn_once(
        ("reward", world_size),
        J.reward_worker,
        world_size,
        str(out_root / f"world{world_size}"),
        configs,
        timeout=SPAWN_TIMEOUT_S[world_size],
    )


def test_pairs_end_on_different_sp_ranks():
    for row in J.reward_rows(16):
        chosen, rejected = len(row["chosen"].split()), len(row["rejected"].split())
        # Any batch is padded to >= 20 tokens (a chosen row) and <= 31 (chosen + eos): halves split at 10..16.
        assert chosen - 1 >= 16 and rejected < 10


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reward_sp2_matches_single_process(name, out_root, record_property):
    ref = _world(1, out_root)[0][name]
    assert ref["attn"] == "sdpa"
    worst = {}
    for rank_results in _world(2, out_root):
        result = rank_results[name]
        assert result["attn"].startswith("hf_longctx_"), result["attn"]
        worst.update(U.compare_logs(result["logs"], ref["logs"], RELATIVE, RTOL))
        # The margin is a difference of O(1) rewards: compared on the rewards' scale, not its own.
        for got, want in zip(result["logs"], ref["logs"], strict=True):
            assert abs(got["margin"] - want["margin"]) <= RTOL * abs(want["mean_reward"]) + 1e-7, (got, want)
            for key in SCORES:
                assert abs(got[key] - want[key]) <= RTOL * max(abs(want[key]), REWARD_FLOOR), (key, got, want)
        assert sorted(result["weights"]) == sorted(ref["weights"])
        for param, want in ref["weights"].items():
            diff = float((result["weights"][param] - want).abs().max() / want.abs().max())
            assert diff <= RTOL, f"{param}: rel {diff:.2e}"
            worst["weights"] = max(worst.get("weights", 0.0), diff)
    assert {"loss", "grad_norm", "accuracy"} <= set(worst)
    record_property("max_rel_diff", worst)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reward_evaluate_sp2_matches_single_process(name, out_root, record_property):
    ref = _world(1, out_root)[0][name]["eval"]
    assert ref["max_reward"] > ref["min_reward"] and ref["loss"] > 0  # scores differ per row: not a constant
    worst = {}
    for rank_results in _world(2, out_root):
        got = rank_results[name]["eval"]
        for key in ("loss", "accuracy", "num_tokens"):
            diff = U.rel_diff(got[key], ref[key])
            assert diff <= RTOL, (key, got[key], ref[key])
            worst[key] = max(worst.get(key, 0.0), diff)
        for key in SCORES:
            assert abs(got[key] - ref[key]) <= RTOL * max(abs(ref[key]), REWARD_FLOOR), (key, got[key], ref[key])
        assert abs(got["margin"] - ref["margin"]) <= RTOL * abs(ref["mean_reward"]) + 1e-7, (got, ref)
    record_property("max_rel_diff", worst)

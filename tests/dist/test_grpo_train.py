"""GRPO `train()` under SP in the configurations RL runs use, against the same run without SP.

Each run (`_grpo_train_jobs.RUNS`: gradient accumulation 2, `num_iterations` 2, `steps_per_generation` and
`generation_batch_size` set explicitly, batch-wide reward std and entropy quantile, ring attention, LoRA with a
KL term) trains at SP=2 on 2 processes and without SP on 1; the DP x SP run trains at DP=2 x SP=2 on 4 processes
and at DP=2 on 2. Sampling is TRL's own. Per step, loss and grad_norm are within 1e-5 and so is every other
logged metric (num_tokens, reward, reward_std, rewards/*/mean|std, completions/*, kl, entropy, clip ratios,
...); every generation is for the same prompts with the same completions; TRL's completion tables (prompts,
completions, rewards, advantages) and the generation sizes are equal.

Before the data-parallel view (issue 32) the SP=2 runs with accumulation 2 or 2 iterations generated again for
earlier prompts, and every run logged a doubled num_tokens and a low reward_std.
"""

from __future__ import annotations

import pytest

from hf_longctx.attention.registry import KEY_PREFIX
from tests.dist import _grpo_train_jobs as J
from tests.dist import _trainer_utils as U

TIMEOUT_S = {1: 300, 2: 500, 4: 600}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("grpo_train")


def _spawn(out_root, world: int, sp: int, names: list[str]) -> list[dict]:
    path = str(out_root / f"w{world}_sp{sp}")
    return U.spawn_once(("grpo_train", world, sp), J.runs_job, world, path, sp, names, timeout=TIMEOUT_S[world])


@pytest.mark.parametrize("run", list(J.RUNS))
def test_sp2_run_matches_without_sp(run: str, out_root, record_property) -> None:
    ref = _spawn(out_root, 1, 1, list(J.RUNS))[0][run]
    # Not vacuous: the policy is trained (a gradient at every step).
    assert all(step["grad_norm"] > 0 for step in ref["steps"])
    ranks = _spawn(out_root, 2, 2, list(J.RUNS))
    backend = J.RUNS[run].get("sp_backend", "ulysses")
    worst: dict[str, float] = {}
    for rank in ranks:
        assert rank[run]["attn"].startswith(f"{KEY_PREFIX}_{backend}_"), rank[run]["attn"]
        assert rank[run]["restored"]  # after detach(): no instance patch left, TRL's gathers are accelerate's
        for key, diff in J.assert_same_run(rank[run], ref).items():
            worst[key] = max(worst.get(key, 0.0), diff)
    record_property("max_rel_diff", worst)


@pytest.mark.slow
def test_dp2_sp2_run_matches_dp2_without_sp(out_root, record_property) -> None:
    """DP=2 x SP=2 on 4 processes against DP=2 on 2: each SP group trains like the DP rank it stands for."""
    names = list(J.DP_RUNS)
    ref = _spawn(out_root, 2, 1, names)
    ranks = _spawn(out_root, 4, 2, names)
    worst: dict[str, float] = {}
    for name in names:
        # The two DP ranks generate for the same prompt with different RNG streams: different completions.
        assert ref[0][name]["generations"] != ref[1][name]["generations"]
        for world_rank, rank in enumerate(ranks):
            for key, diff in J.assert_same_run(rank[name], ref[world_rank // 2][name]).items():
                worst[key] = max(worst.get(key, 0.0), diff)
    record_property("max_rel_diff", worst)

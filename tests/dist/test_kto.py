"""TRL `KTOTrainer` under hf_longctx SP is exact: SP against the same run without SP, per step.

The SP runs compute each row's summed log-probability (and its mismatched KL pair's) on their shards and add it
over the SP group; the runs without SP are TRL's own code. Compared per step: every logged metric (loss,
grad_norm, kl, entropy, num_tokens, logits/*, rewards/*, logps/*, aux_loss), every trainable parameter's gradient
at every optimizer step (after the engine's average; under ZeRO-3 the trained weights instead), and the
`evaluate()` metrics. Batches hold a long row whose completion straddles the shard boundaries and a short row
that lies entirely in SP rank 0's shard; two micro-batches are all desirable / all undesirable.

Configurations: SP=2 on 2 processes and SP=4 on 4 against 1 process; DP=2 x SP=2 with ZeRO-3 on 4 processes
against DP=2 with ZeRO-3 on 2. Before this, `KTOTrainer(...)` under SP raised `NotImplementedError`.
"""

from __future__ import annotations

import math

import pytest

from hf_longctx.attention.registry import KEY_PREFIX
from tests.dist import _kto_jobs as J
from tests.dist import _trainer_utils as U

RTOL = 1e-5
GRAD_RTOL = 1e-4  # per parameter, relative to its largest gradient entry
# Rewards are beta x (policy - reference log-prob) and kl a mean of such differences: two sums of O(50) per-token
# terms whose rounding scales with the sums, not with the (often small) difference. Compared within RTOL of
# beta x |logps| (rewards) and |logps| (kl); the log-probs themselves, and the loss, at RTOL of their own size.
REWARD_KEYS, KL_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins"), ("kl",)
# `logits/*` is the vocabulary mean of the logits, near 0 at random init while its rounding scales with the logits
# (O(0.1)): compared within RTOL of max(|value|, LOGIT_FLOOR), as in test_dpo.py.
LOGIT_KEYS, LOGIT_FLOOR = ("logits/chosen", "logits/rejected"), 1e-2
TIMEOUT_S = {1: 300, 2: 400, 4: 600}
# A separate reference model, loss_type="kto" with desirable / undesirable weights, gradient accumulation 2,
# evaluated at the end (its KL pairs too).
REF_MODEL = {
    "gradient_accumulation_steps": 2,
    "evaluate": True,
    "desirable_weight": 1.3,
    "undesirable_weight": 0.7,
}
CONFIGS = {
    "ref_model": REF_MODEL,
    # LoRA through peft_config: the reference is the policy with its adapter disabled; APO-zero (no KL term, so
    # TRL builds no KL pairs) on a Qwen3-MoE policy with its router loss on (coefficient 0.3, LoRA on the routers).
    "peft_apo_moe": {"reference": "peft", "loss_type": "apo_zero_unpaired", "arch": "moe:qwen3_moe"},
    # The reference's log-probs, KL pairs included, precomputed by TRL before training (on shards too); ring
    # attention, whose zigzag layout both batches follow.
    "precompute": {"reference": "precompute", "precompute_ref_batch_size": 4, "sp_options": {"sp_backend": "ring"}},
}
# DP=2 with DeepSpeed ZeRO-3 (TRL prepares the reference model itself), precomputed reference log-probs gathered
# over the DP ranks, gradient accumulation 2: run at SP=2 on 4 processes and without SP on 2.
DP_ZERO3 = {"zero": 3, "reference": "precompute", "gradient_accumulation_steps": 2}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("kto")


def _spawn(out_root, world: int, configs: dict[str, dict]) -> list[dict]:
    path = str(out_root / f"world{world}")
    return U.spawn_once(("kto", world), J.kto_worker, world, path, configs, timeout=TIMEOUT_S[world])


def _reference(out_root) -> dict:
    return _spawn(out_root, 1, CONFIGS)[0]


def _sp2(out_root) -> list[dict]:
    # The last run is the DP=2 ZeRO-3 run without SP (the 4-process test's reference): ZeRO comes last in a worker.
    return _spawn(out_root, 2, {**{n: {**c, "sp": 2} for n, c in CONFIGS.items()}, "dp_zero3": DP_ZERO3})


def _world4(out_root) -> list[dict]:
    return _spawn(out_root, 4, {"ref_model": {**REF_MODEL, "sp": 4}, "dp_zero3": {**DP_ZERO3, "sp": 2}})


def _compare_metrics(got: dict, want: dict, worst: dict) -> None:
    """One step's (or evaluation's) metrics: the same keys, every value as the module docstring says."""
    assert sorted(got) == sorted(want)
    strip = lambda key: key.removeprefix("eval_")  # noqa: E731
    logps = [abs(v) for k, v in want.items() if strip(k).startswith("logps/")]
    scale = max(logps, default=0.0)
    for key, value in want.items():
        name = strip(key)
        floor = abs(value)
        if name in REWARD_KEYS:
            floor = max(floor, J.BETA * scale)
        elif name in KL_KEYS:
            floor = max(floor, scale)
        elif name in LOGIT_KEYS:
            floor = max(floor, LOGIT_FLOOR)
        assert math.isfinite(got[key]), (key, got)
        diff = abs(got[key] - value) / floor if floor > 0 else abs(got[key])
        assert diff <= RTOL, f"step {want.get('step', 'eval')} {key}: {got[key]!r} vs {value!r} (rel {diff:.2e})"
        if name not in J.NOT_METRICS:
            worst[name] = max(worst.get(name, 0.0), diff)


def _compare_runs(got: dict, want: dict, sp: int, backend: str = "ulysses") -> dict[str, float]:
    """Everything `run_kto` returns, for one rank of an SP run against the run without SP; the worst diffs."""
    assert got["spans"] == want["spans"]  # the same full batches, in order
    assert got["attn"].startswith(KEY_PREFIX) and want["attn"] == "sdpa", (got["attn"], want["attn"])
    assert got["attn"].startswith(f"{KEY_PREFIX}_{backend}"), (got["attn"], backend)
    # Detaching restores the trainer: TRL's methods and collator.
    assert got["undone"] == {"patched": sorted(J.PATCHED), "left": [], "collator": "DataCollatorForUnpairedPreference"}
    worst: dict[str, float] = {}
    assert len(got["logs"]) == len(want["logs"]) >= 3
    for mine, ref in zip(got["logs"], want["logs"], strict=True):
        _compare_metrics(mine, ref, worst)
    if want["eval"]:
        _compare_metrics(got["eval"], want["eval"], worst)
    assert len(got["grads"]) == len(want["grads"])
    for mine, ref in zip(got["grads"], want["grads"], strict=True):
        assert sorted(mine) == sorted(ref) and ref
        for name, grad in ref.items():
            diff = float((mine[name] - grad).abs().max() / grad.abs().max().clamp(min=1e-30))
            assert diff <= GRAD_RTOL, f"{name}: gradient rel {diff:.2e}"
            worst["grads"] = max(worst.get("grads", 0.0), diff)
    assert sorted(got["weights"]) == sorted(want["weights"])
    for name, weight in want["weights"].items():
        diff = float((got["weights"][name] - weight).abs().max() / weight.abs().max())
        assert diff <= RTOL, f"{name}: weight rel {diff:.2e}"
        worst["weights"] = max(worst.get("weights", 0.0), diff)
    _assert_boundary_rows(want["spans"], sp, backend)
    return worst


def _merge(worst: dict[str, float], more: dict[str, float]) -> None:
    for key, value in more.items():
        worst[key] = max(worst.get(key, 0.0), value)


def _assert_boundary_rows(spans: list, sp: int, backend: str) -> None:
    """Some completion straddles a shard boundary and some row lies entirely in SP rank 0's shard (its first chunk:
    one of `sp` contiguous chunks, or of 2 x sp in ring's zigzag layout)."""
    chunks = 2 * sp if backend == "ring" else sp
    straddles = held_by_rank0 = 0
    for batch in spans:
        for start, end, length in batch:
            chunk = -(-length // chunks)  # the batch padded to a multiple of the chunk count
            straddles += any(start < k * chunk < end for k in range(1, chunks))
            held_by_rank0 += end <= chunk
    assert straddles > 0 and held_by_rank0 > 0, spans


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kto_sp2_matches_single_process(name, out_root, record_property):
    want = _reference(out_root)[name]
    worst: dict[str, float] = {}
    for rank in _sp2(out_root):
        backend = CONFIGS[name].get("sp_options", {}).get("sp_backend", "ulysses")
        _merge(worst, _compare_runs(rank[name], want, sp=2, backend=backend))
    assert {"loss", "grad_norm", "kl", "entropy", "rewards/chosen", "logps/rejected", "grads"} <= set(worst)
    assert ("aux_loss" in worst) == ("arch" in CONFIGS[name])  # the router loss was compared, where it is on
    positive_kl = [h["kl"] > 0 for h in want["logs"]]
    assert all(positive_kl) if CONFIGS[name].get("loss_type") is None else not any(positive_kl)
    if name == "ref_model":
        assert "eval_loss" in want["eval"] and "eval_kl" in want["eval"]
        assert "rewards/margins" in worst and "logits/rejected" in worst
    record_property("max_rel_diff", worst)


@pytest.mark.slow
def test_kto_sp4_and_dp2_sp2_zero3_match_without_sp(out_root, record_property):
    ref_model, dp_zero3 = _reference(out_root)["ref_model"], [rank["dp_zero3"] for rank in _sp2(out_root)]
    # Both DP ranks of the run without SP log the same (gathered) metrics; each reads its own rows.
    assert dp_zero3[0]["logs"] == dp_zero3[1]["logs"] and dp_zero3[0]["spans"] != dp_zero3[1]["spans"]
    assert dp_zero3[0]["weights"] and not dp_zero3[0]["grads"]
    worst: dict[str, dict[str, float]] = {"sp4": {}, "dp2_sp2_zero3": {}}
    for rank, result in enumerate(_world4(out_root)):
        _merge(worst["sp4"], _compare_runs(result["ref_model"], ref_model, sp=4))
        # Ranks 0-1 form the SP group of DP rank 0, ranks 2-3 that of DP rank 1.
        _merge(worst["dp2_sp2_zero3"], _compare_runs(result["dp_zero3"], dp_zero3[rank // 2], sp=2))
    record_property("max_rel_diff", worst)


def test_refused_option_is_named_at_construction(out_root):
    for rank in _sp2(out_root):
        message = rank["refused"]
        assert message is not None, "KTOTrainer(compute_metrics=...) was constructed under SP=2"
        assert message.startswith("KTOTrainer is not supported with hf_longctx sequence parallelism"), message
        assert "compute_metrics" in message and "compute_metrics=None" in message, message

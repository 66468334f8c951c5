"""Stock `transformers.Trainer` with `parallelism_config=hf_longctx.ParallelismConfig(sp_size=2)` is exact.

Every check compares the SP run with the same run without SP (float32, CPU, gloo): per-step loss and
grad_norm, rows consumed per step, the epoch/LR bookkeeping, eval loss, resume. One spawn per world size
(1: references; 2: SP=2, plain DDP, misconfigurations; 4: DP=2 x SP=2) runs every configuration in a row
(`_trainer_utils.trainer_worker`); the tests read the cached results.
"""

from __future__ import annotations

import math

import pytest

from tests.dist import _trainer_utils as U

RTOL = 1e-5
RESUME_RTOL = 1e-6
SPAWN_TIMEOUT_S = {1: 300, 2: 400, 4: 600}

# Configurations run at world 1 (no SP) and at world 2 with sp=2 (DP=1): see `_trainer_utils.run_trainer`.
CONFIGS = {
    "sgd": {"optim": "sgd", "eval_data": (("eval", 8), ("eval", 7))},
    "adamw": {"optim": "adamw_torch"},
    "ga2": {"ga": 2},
    "tail2": {"data": ("tail2", 12)},
    "epoch": {"epochs": 1.0, "scheduler": "linear", "data": ("mixed", 12)},
    # 24 rows = 12 batches: the step-3 checkpoint is mid-epoch; AdamW + linear decay have state to restore.
    "resume_full": {"optim": "adamw_torch", "scheduler": "linear", "steps": 6, "save_steps": 3},
    "smooth": {"label_smoothing": 0.1, "eval_data": (("eval", 7),)},
    "subclass": {"subclass": True, "steps": 2, "eval_data": (("eval", 7),), "predict": ("eval", 7)},
    "lossfn": {"loss_func": True, "steps": 3},
    # train_sampling_strategy: "random" (the default) is every config above; GA 2 gives batch_rebalance two
    # micro-batches per step to balance (of variable size).
    "sequential": {"sampling": "sequential", "steps": 3},
    "group_by_length": {"sampling": "group_by_length", "steps": 3},
    "batch_rebalance": {"sampling": "batch_rebalance", "steps": 3, "ga": 2},
}
WORLD2_EXTRA = {
    "resume": {**CONFIGS["resume_full"], "sp": 2, "resume_from": "resume_full/checkpoint-3"},
    "ddp": {"steps": 3, "predict": ("eval", 7)},  # plain DDP over 2 ranks: the reference of DP=2 x SP=2
    "ddp_rebalance": {"steps": 3, "sampling": "batch_rebalance"},
    # accelerate's own FSDP2 route (fully_shard per layer) with gradient checkpointing; last: it changes the
    # process's accelerate state.
    "fsdp2": {"sp": 2, "steps": 3, "fsdp2": True, "gradient_checkpointing": True},
}
DPSP = {
    "dpsp": {"steps": 3, "sp": 2, "predict": ("eval", 7)},
    "dpsp_rebalance": {"steps": 3, "sp": 2, "sampling": "batch_rebalance"},
}
# The train_sampling_strategy of each config above ("sgd": the default, random).
SAMPLING = {n: n for n in ("sequential", "group_by_length", "batch_rebalance")} | {"sgd": "random"}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("trainer")


def _world(world_size: int, out_root) -> list[dict]:
    """Per-rank results of the spawn for `world_size` (run once per session)."""
    if world_size == 1:
        configs, errors = CONFIGS, False
    elif world_size == 2:
        configs, errors = {**{k: {**v, "sp": 2} for k, v in CONFIGS.items()}, **WORLD2_EXTRA}, True
    else:
        configs, errors = DPSP, False
    out_dir = str(out_root / f"world{world_size}")
    return U.spawn_once(
        ("trainer", world_size),
        U.trainer_worker,
        world_size,
        out_dir,
        configs,
        errors,
        timeout=SPAWN_TIMEOUT_S[world_size],
    )


def _sp_and_ref(name: str, out_root) -> tuple[list[dict], dict]:
    """The SP=2 results of config `name` on both ranks, and the world-1 reference."""
    sp = [rank_results[name] for rank_results in _world(2, out_root)]
    ref = _world(1, out_root)[0][name]
    return sp, ref


def _assert_train_matches(name: str, out_root, keys=("loss", "grad_norm"), rtol=RTOL) -> dict[str, float]:
    sp, ref = _sp_and_ref(name, out_root)
    worst: dict[str, float] = {}
    for result in sp:
        for key, value in U.compare_logs(result["logs"], ref["logs"], keys, rtol).items():
            worst[key] = max(worst.get(key, 0.0), value)
    return worst


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_sp2_matches_single_process_per_step(name, out_root, record_property):
    worst = _assert_train_matches(name, out_root)

    _, ref = _sp_and_ref(name, out_root)
    assert [h["step"] for h in ref["logs"]] == [1, 2, 3, 4, 5]
    assert set(worst) == {"loss", "grad_norm"}
    record_property("max_rel_diff", worst)


def test_gradient_accumulation_sp2_matches_single_process(out_root, record_property):
    worst = _assert_train_matches("ga2", out_root)

    sp, ref = _sp_and_ref("ga2", out_root)
    assert len(ref["logs"]) == 5
    # Two micro-batches per optimizer step on every rank.
    assert len(sp[0]["seq_lens"]) == len(ref["seq_lens"]) == 10
    record_property("max_rel_diff", worst)


def test_completion_only_with_empty_shard_is_exact_and_finite(out_root, record_property):
    worst = _assert_train_matches("tail2", out_root)

    sp, ref = _sp_and_ref("tail2", out_root)
    # Rank 0's shard never holds a valid label, rank 1's always does; the loss is still the global mean.
    assert sp[0]["valid_labels"] == [0] * 5
    assert all(n > 0 for n in sp[1]["valid_labels"])
    assert [a + b for a, b in zip(sp[0]["valid_labels"], sp[1]["valid_labels"], strict=True)] == ref["valid_labels"]
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for r in sp for h in r["logs"])
    record_property("max_rel_diff", worst)


@pytest.mark.parametrize(("name", "micro_batches"), [("sgd", 5), ("ga2", 10), ("epoch", 6)])
def test_rows_per_step_match_single_process(name, micro_batches, out_root):
    sp, ref = _sp_and_ref(name, out_root)

    expected = ref["rows"][:micro_batches]
    assert len(expected) == micro_batches
    for rank, result in enumerate(sp):
        assert result["rows"][:micro_batches] == expected, rank
    if name == "epoch":
        assert sorted(r for batch in expected for r in batch) == list(range(12))


def test_epoch_based_linear_schedule_matches_single_process(out_root, record_property):
    worst = _assert_train_matches("epoch", out_root, keys=("loss", "grad_norm", "learning_rate", "epoch"))

    sp, ref = _sp_and_ref("epoch", out_root)
    # 12 rows, batch 2, DP=1 in both runs: 6 steps, one full epoch, LR decayed to 0 (not 12 steps / 0.5).
    assert ref["max_steps"] == ref["global_step"] == 6
    assert ref["epoch"] == 1.0
    for result in sp:
        assert result["max_steps"] == result["global_step"] == 6
        assert result["epoch"] == 1.0
        assert [h["learning_rate"] for h in result["logs"]] == [h["learning_rate"] for h in ref["logs"]]
    record_property("max_rel_diff", worst)


@pytest.mark.parametrize("n_rows", [8, 7], ids=["full_batches", "partial_last_batch"])
def test_eval_loss_sp2_matches_single_process(n_rows, out_root, record_property):
    sp, ref = _sp_and_ref("sgd", out_root)

    want = ref["eval_loss"][n_rows]
    assert math.isfinite(want)
    for result in sp:
        got = result["eval_loss"][n_rows]
        assert U.rel_diff(got, want) <= RTOL, f"eval_loss {got!r} vs {want!r} (rel {U.rel_diff(got, want):.2e})"
    record_property("max_rel_diff", max(U.rel_diff(r["eval_loss"][n_rows], want) for r in sp))


def test_resume_mid_epoch_reproduces_uninterrupted_sp2_run(out_root, record_property):
    world2 = _world(2, out_root)

    worst = 0.0
    for rank_results in world2:
        full = rank_results["resume_full"]["logs"]
        resumed = [h for h in rank_results["resume"]["logs"] if h["step"] > 3]
        assert [h["step"] for h in resumed] == [4, 5, 6]
        diffs = U.compare_logs(resumed, full[3:], ("loss", "grad_norm", "learning_rate"), RESUME_RTOL)
        worst = max(worst, *diffs.values())
        assert rank_results["resume"]["global_step"] == 6
        # The resumed run trained only steps 4-6.
        assert len(rank_results["resume"]["seq_lens"]) == 3
    # The uninterrupted SP run itself matches the reference.
    _assert_train_matches("resume_full", out_root)
    record_property("max_rel_diff", worst)


def test_sp_is_active_inside_the_workers(out_root):
    sp, ref = _sp_and_ref("sgd", out_root)

    assert ref["attn"] == "sdpa"
    for result in sp:
        assert result["attn"].startswith("hf_longctx_ulysses"), result["attn"]
        assert result["attn_after_detach"] == "sdpa" and result["hooks_after_detach"] == 0
        assert result["accelerator_clean"]
        full_lens = result["lengths"][: len(result["seq_lens"])]
        assert len(result["seq_lens"]) == 5
        assert result["seq_lens"] == [math.ceil(n / 2) for n in full_lens]
        assert max(full_lens) > min(full_lens)  # variable-length batches, odd ones included
        assert any(n % 2 for n in full_lens)
    assert ref["seq_lens"] == ref["lengths"][:5]


def test_missing_use_cpu_raises_on_every_rank(out_root):
    for rank_results in _world(2, out_root):
        message = rank_results["errors"]["no_use_cpu"]
        assert message is not None, "no ValueError without use_cpu=True"
        assert "use_cpu" in message


def test_ranks_without_a_data_parallel_engine_raise_on_every_rank(out_root):
    """ddp_backend="gloo" without use_cpu on CPU: accelerate counts both ranks but wraps no DDP (measured:
    DistributedType.NO), so each SP rank would step on its own shard's gradients."""
    for rank_results in _world(2, out_root):
        message = rank_results["errors"]["no_engine"]
        assert message is not None and "runs no data-parallel engine" in message, message


def test_sp_size_not_dividing_world_raises_on_every_rank(out_root):
    for rank_results in _world(2, out_root):
        message = rank_results["errors"]["sp3"]
        assert message is not None, "no ValueError for sp_size=3 at world size 2"
        assert "sp_size=3" in message


def test_accelerate_fsdp2_route_with_checkpointing_sp2_matches_single_process(out_root, record_property):
    """The pairing configs/fsdp2_sp8.yaml documents: accelerate's FSDP2 preparation (fully_shard) plus the
    recipe's gradient_checkpointing, at SP=2, equals the single-process run step by step."""
    ref = _world(1, out_root)[0]["sgd"]
    worst: dict[str, float] = {}
    for result in (rank_results["fsdp2"] for rank_results in _world(2, out_root)):
        assert result["wrapped"].startswith("FSDP"), result["wrapped"]  # fully_shard really applied
        for key, value in U.compare_logs(result["logs"], ref["logs"][:3], ("loss", "grad_norm"), RTOL).items():
            worst[key] = max(worst.get(key, 0.0), value)
    record_property("max_rel_diff", worst)


def test_heads_not_divisible_refused_when_the_trainer_is_built(out_root):
    for rank_results in _world(2, out_root):
        message = rank_results["errors"]["heads3"]
        assert message is not None and message.startswith("init: "), message
        assert "num_attention_heads (3) divisible by sp_size (2)" in message


def test_unmarked_compute_loss_func_is_refused(out_root):
    for rank_results in _world(2, out_root):
        message = rank_results["errors"]["unmarked_loss"]
        assert message is not None and message.startswith("train: "), message
        assert "takes_shifted_labels" in message


@pytest.mark.parametrize("name", ["smooth", "lossfn"])
def test_loss_options_sp2_match_single_process(name, out_root, record_property):
    """label_smoothing_factor and a (marked) compute_loss_func: per-step loss and grad_norm as without SP."""
    worst = _assert_train_matches(name, out_root)
    sp, ref = _sp_and_ref(name, out_root)
    for result in sp:
        for n, want in ref["eval_loss"].items():
            assert U.rel_diff(result["eval_loss"][n], want) <= RTOL, (n, result["eval_loss"][n], want)
    record_property("max_rel_diff", worst)


def _assert_predictions_match(got: dict, want: dict) -> None:
    assert U.rel_diff(got["loss"], want["loss"]) <= RTOL, (got["loss"], want["loss"])
    # Whole sequences, unshifted labels, cut to the batch's real length: exactly what a run without SP returns.
    assert got["label_ids"] == want["label_ids"]
    assert got["first_tokens"] == want["first_tokens"]
    for a, b in zip(got["mean_logit"], want["mean_logit"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (a, b)


def test_eval_and_predict_through_a_subclass_match_single_process(out_root):
    """A Trainer subclass whose prediction_step calls super(): eval loss not halved, predictions and label_ids
    (per-sample [bs, 3] and [bs] metric outputs included) equal to the run without SP."""
    sp, ref = _sp_and_ref("subclass", out_root)
    for result in sp:
        got, want = result["eval_loss"][7], ref["eval_loss"][7]
        assert U.rel_diff(got, want) <= RTOL, f"eval_loss {got!r} vs {want!r}"
        _assert_predictions_match(result["predict"], ref["predict"])
    assert len(ref["predict"]["first_tokens"]) == 7 and len(ref["predict"]["first_tokens"][0]) == 3


@pytest.mark.slow
def test_dp2_sp2_matches_plain_ddp(out_root, record_property):
    world4, world2 = _world(4, out_root), _world(2, out_root)
    worst = _assert_dp_sp_matches_ddp(world4, world2, "dpsp", "ddp")
    for rank, rank_results in enumerate(world4):
        assert rank_results["dpsp"]["attn"].startswith("hf_longctx_ulysses")
        # predict() with different batch lengths across DP ranks: whole sequences padded, as with DDP.
        _assert_predictions_match(rank_results["dpsp"]["predict"], world2[rank // 2]["ddp"]["predict"])
    assert [h["step"] for h in world2[0]["ddp"]["logs"]] == [1, 2, 3]
    record_property("max_rel_diff", worst)


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_every_train_sampling_strategy_sp2_matches_single_process(name, out_root, record_property):
    """Each `train_sampling_strategy` transformers offers, at SP=2 (DP=1), reads the micro-batches of the run
    without SP and matches it step by step; batch_rebalance, built by the Trainer for every process as a DP
    rank, gave the two SP ranks different samples ("Sequence-parallel ranks hold different batches")."""
    from transformers import TrainingArguments

    offered = TrainingArguments.__dataclass_fields__["train_sampling_strategy"].metadata["choices"]
    assert sorted(offered) == sorted(SAMPLING.values())  # a new strategy needs a config here
    worst = _assert_train_matches(name, out_root)
    sp, ref = _sp_and_ref(name, out_root)
    for result in sp:
        assert result["rows"][: len(ref["rows"])] == ref["rows"]
    record_property("max_rel_diff", worst)


@pytest.mark.slow
def test_batch_rebalance_dp2_sp2_matches_plain_ddp(out_root, record_property):
    """DP=2 x SP=2: the two SP groups rebalance the step's samples as two DDP ranks without SP do."""
    worst = _assert_dp_sp_matches_ddp(_world(4, out_root), _world(2, out_root), "dpsp_rebalance", "ddp_rebalance")
    record_property("max_rel_diff", worst)


def _assert_dp_sp_matches_ddp(world4: list, world2: list, sp_run: str, ddp_run: str) -> dict[str, float]:
    """DP=2 x SP=2 (`sp_run` on 4 ranks) against plain DDP (`ddp_run` on 2): per-step loss and grad_norm, and
    DP rank rank // 2 of the SP run reads the rows DDP rank rank // 2 reads (the two DP ranks differ)."""
    worst: dict[str, float] = {}
    for rank, rank_results in enumerate(world4):
        result, ref = rank_results[sp_run], world2[rank // 2][ddp_run]
        for key, value in U.compare_logs(result["logs"], ref["logs"], ("loss", "grad_norm"), RTOL).items():
            worst[key] = max(worst.get(key, 0.0), value)
        assert result["rows"][:3] == ref["rows"][:3], rank
    assert world2[0][ddp_run]["rows"][:3] != world2[1][ddp_run]["rows"][:3]
    return worst


def test_first_step_logs_what_runs_on_rank_0(out_root):
    """One line, at the first step, on rank 0 only: DP x SP, engine, backend, kernel, tokens per rank, flags."""
    sp, ref = _sp_and_ref("sgd", out_root)
    assert ref["sp_lines"] == []  # no SP, no line
    assert sp[1]["sp_lines"] == []
    (line,) = sp[0]["sp_lines"]
    full = sp[0]["lengths"][0]
    prefix = "hf_longctx: sequence parallelism on 2 ranks (1 node x 2): DP 1 x SP 2, engine DDP, backend ulysses"
    assert line.startswith(prefix), line
    assert f"attention kernel sdpa, {math.ceil(full / 2)} of {full} tokens per rank" in line
    assert line.endswith("memory flags: none")
    (line,) = _world(4, out_root)[0]["dpsp"]["sp_lines"]
    assert "on 4 ranks (1 node x 4): DP 2 x SP 2" in line


def test_heads_and_adapters_without_an_exact_sp_path_are_refused_when_the_trainer_is_built(out_root):
    """A model with no head hf_longctx knows (a bare LlamaModel) and a ShadowPEFT adapter stop in `Trainer(...)`,
    naming the class; a token classifier's loss taken by a compute_loss_func (per shard) stops at `train()`."""
    for rank_results in _world(2, out_root):
        errors = rank_results["errors"]
        assert errors["unknown_head"].startswith("init: Trainer with LlamaModel is not supported"), errors
        assert errors["shadow"].startswith("init: ") and "(SHADOW)" in errors["shadow"], errors
        assert errors["token_loss_func"].startswith("train: ") and "token classification" in errors["token_loss_func"]


def test_sp_asked_but_not_applied_is_an_error(out_root):
    """A run that asks for SP and would train without it stops: a wrapper module trained (its transformers model
    never switched: each rank would attend over its own shard) at the first step, on every rank; arguments the
    accelerator never saw (an Accelerator made earlier, use_configured_state) when the Trainer is built."""
    for rank_results in _world(2, out_root):
        message = rank_results["errors"]["wrapper"]
        assert message is not None and message.startswith("train: "), message
        assert "does not run on ranks [0, 1]" in message and "(Wrapper) carries no hf_longctx SP attention" in message
        message = rank_results["errors"]["configured_state"]
        assert message is not None and message.startswith("init: "), message
        assert "sp_size=2" in message and "use_configured_state" in message

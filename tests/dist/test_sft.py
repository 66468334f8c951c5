"""TRL `SFTTrainer` with `parallelism_config=hf_longctx.ParallelismConfig(sp_size=2)` is exact.

SP=2 (world 2) against world 1 without SP, per step: loss, grad_norm, mean_token_accuracy, num_tokens (and
entropy): padded rows, packing (bfd, padding-free; the reference is the per-document computation), completion-
only loss, eval, an epoch ending on a partial batch. One spawn per world size runs every configuration
(`_sft_utils.sft_worker`); the tests read the cached results.
"""

from __future__ import annotations

import math

import pytest

from tests.dist import _sft_utils as SU
from tests.dist import _trainer_utils as U

RTOL = 1e-5
SPAWN_TIMEOUT_S = {1: 300, 2: 400}
KEYS = ("loss", "grad_norm", "mean_token_accuracy", "num_tokens", "entropy")
EVAL_SETS = {"even": ("plain", 8), "odd": ("plain", 7)}  # 7 rows: the last eval batch is partial

# name -> (world-1 reference config, SP=2 config); see `_sft_utils.run_sft`.
CONFIGS = {
    "nopack": ({"eval_data": EVAL_SETS}, {"eval_data": EVAL_SETS}),
    # The reference keeps packed documents apart by construction (hf_longctx attention at SP=1).
    # 40 rows pack into ~12 rows of <= 64 tokens: the 4 steps stay inside the first epoch.
    "pack": ({"packing": True, "doc_exact": True, "data": ("plain", 40)}, {"packing": True, "data": ("plain", 40)}),
    "completion": ({"data": ("completion", 16), "completion_only": True},) * 2,
    # 7 rows, batch 2, one epoch: the 4th (last) step holds one row.
    "epoch_end": ({"data": ("plain", 7), "epochs": 1.0},) * 2,
}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("sft")


def _world(world_size: int, out_root) -> list[dict]:
    if world_size == 1:
        configs = {name: ref for name, (ref, _) in CONFIGS.items()}
    else:
        configs = {name: {**sp, "sp": 2} for name, (_, sp) in CONFIGS.items()}
    return U.spawn_once(
        ("sft", world_size),
        SU.sft_worker,
        world_size,
        str(out_root / f"world{world_size}"),
        configs,
        timeout=SPAWN_TIMEOUT_S[world_size],
    )


def _sp_and_ref(name: str, out_root) -> tuple[list[dict], dict]:
    sp = [rank_results[name] for rank_results in _world(2, out_root)]
    return sp, _world(1, out_root)[0][name]


def _assert_sft_matches(name: str, out_root, record_property) -> tuple[list[dict], dict]:
    sp, ref = _sp_and_ref(name, out_root)
    worst: dict[str, float] = {}
    for result in sp:
        assert result["attn"].startswith("hf_longctx_ulysses"), result["attn"]
        for key, value in U.compare_logs(result["logs"], ref["logs"], KEYS, RTOL).items():
            worst[key] = max(worst.get(key, 0.0), value)
        assert [h["num_tokens"] for h in result["logs"]] == [h["num_tokens"] for h in ref["logs"]]
    assert {"loss", "grad_norm", "mean_token_accuracy", "num_tokens"} <= set(worst)
    record_property("max_rel_diff", worst)
    return sp, ref


def test_sft_no_packing_sp2_matches_single_process(out_root, record_property):
    sp, ref = _assert_sft_matches("nopack", out_root, record_property)

    assert len(ref["logs"]) == 4
    assert ref["attn"] == "sdpa"
    # Each rank ran its half of every padded batch.
    for result in sp:
        assert result["seq_lens"] == [math.ceil(n / 2) for n in ref["seq_lens"]]


def test_sft_packing_sp2_matches_document_exact_reference(out_root, record_property):
    sp, ref = _assert_sft_matches("pack", out_root, record_property)

    for result in sp:
        assert result["seq_lens"] == [math.ceil(n / 2) for n in ref["seq_lens"]]
    # Padding-free: each batch is one row of several documents (the longest document has 29 tokens).
    assert min(ref["seq_lens"]) > 2 * 29
    assert len(ref["logs"]) == 4


def test_sft_completion_only_sp2_matches_single_process(out_root, record_property):
    sp, ref = _assert_sft_matches("completion", out_root, record_property)

    # Completion-only labels: some SP rank-0 shards hold no valid label at all.
    assert 0 in sp[0]["valid_labels"]
    assert [a + b for a, b in zip(sp[0]["valid_labels"], sp[1]["valid_labels"], strict=True)] == ref["valid_labels"]
    # The completion mask was applied: fewer than half of the positions carry a label.
    assert sum(ref["valid_labels"]) < sum(ref["seq_lens"])


def test_sft_epoch_ending_on_partial_batch_matches_single_process(out_root, record_property):
    sp, ref = _assert_sft_matches("epoch_end", out_root, record_property)

    assert ref["global_step"] == 4
    assert all(result["global_step"] == 4 for result in sp)


@pytest.mark.parametrize("eval_set", list(EVAL_SETS))
def test_sft_eval_sp2_matches_single_process(eval_set, out_root, record_property):
    sp, ref = _sp_and_ref("nopack", out_root)

    want = ref["eval"][eval_set]
    worst = 0.0
    for result in sp:
        got = result["eval"][eval_set]
        for metric in ("loss", "mean_token_accuracy"):
            diff = U.rel_diff(got[metric], want[metric])
            assert diff <= RTOL, f"eval {metric}: {got[metric]!r} vs {want[metric]!r} (rel {diff:.2e})"
            worst = max(worst, diff)
    record_property("max_rel_diff", worst)

"""Head-chunked Ulysses (`ulysses_head_chunks`) is exact: chunks vs no chunks vs no SP (gloo, CPU, SP=2).

One spawn runs every (model, kernel, case, chunks) step through `enable_sequence_parallel`; the SP=1
references come from `_parity` (explicit document-causal mask, hand-built labels) in this process. Shapes
cover each way a chunk gets its key/value heads: a slice of the rank's own (GQA 8x4, MHA 4x4), the one
replicated head sent with every chunk (GQA 4x2: one kv head per rank), and per-query-head copies (12x3),
plus per-head sinks (GPT-OSS, eager) and layer checkpointing around the chunks' own checkpoints. A Trainer
run with the option on matches the run without SP step by step.
"""

from __future__ import annotations

import pytest
import torch

import hf_longctx
from hf_longctx.instrument import record_collectives
from tests.dist import _parity as P
from tests.dist import _trainer_utils as U

SPAWN_TIMEOUT_S = 240
GQA8 = P.ModelSpec("llama", 8, 4, 128, "gqa")
SPECS = {GQA8.id: GQA8, **P.SPECS_BY_ID}
# (spec id, kernel, case, chunks, layer checkpointing): chunks = 1 is plain Ulysses, the baseline.
COMBOS = tuple(
    (spec, attn, case, chunks, gc)
    for spec, attn, case, valid, gc in (
        (GQA8.id, "sdpa", "packed3", (2,), None),
        (GQA8.id, "sdpa", "padded_bs2", (2,), None),
        (GQA8.id, "sdpa", "packed3", (2,), "reentrant"),
        (GQA8.id, "sdpa", "packed3", (2,), "non_reentrant"),
        ("llama-mha4x4-h64", "sdpa", "packed3", (2,), None),
        ("llama-mha4x4-h64", "eager", "packed3", (2,), None),
        ("llama-gqa4x2-h64", "sdpa", "packed3", (2,), None),
        ("llama-gqa_irregular12x3-h192", P.FLASH, "packed3", (3, 6), None),
        ("gpt_oss-sinks4x2-h64", "eager", "packed3", (2,), None),
    )
    for chunks in (1, *valid)
)
TRAINER_CONFIGS = {
    "chunks2_gc": {"gradient_checkpointing": True, "sp_options": {"ulysses_head_chunks": 2}},
    "chunks2_flags": {
        "gradient_checkpointing": True,
        "sp_options": {"ulysses_head_chunks": 2},
        "flags": {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True},
    },
}


def head_chunks_worker(rank: int, world_size: int, combos: tuple, out_dir: str) -> dict:
    """Every combo at SP=world_size (rank 0 returns the averaged gradients), a bad chunk count, then the
    Trainer runs (one spawn: importing and spawning cost more than the steps)."""
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    P.flash_standin.install()
    results: dict = {}
    for spec_id, attn, case_name, chunks, gc in combos:
        model = SPECS[spec_id].build(attn)
        if gc is not None:
            model.activation_checkpointing_enable({"use_reentrant": gc == "reentrant"})
        with hf_longctx.enable_sequence_parallel(model, groups, ulysses_head_chunks=chunks):
            batch = P.make_case(case_name).batch
            shard = hf_longctx.shard_batch(batch, groups)
            shift_labels = shard.pop("shift_labels")
            with record_collectives() as forward:
                logits = model(**shard).logits
            a2a = dict(vars(forward.ops["all_to_all"]))  # now: the backward's add to the forward's recorder
            loss = hf_longctx.sequence_parallel_loss(logits, shift_labels, groups)
            loss.backward()
            grads = P._averaged_grads(model, groups)
            results[(spec_id, attn, case_name, chunks, gc)] = {
                "loss": loss.item(),
                "forward_a2a_calls": a2a["calls"],
                "forward_a2a_bytes": a2a["bytes_sent"],
                "grads": grads if rank == 0 else None,
            }
    # 4 query / 2 kv heads at SP=2: each rank attends 2 query heads of one kv head, so 1 or 2 chunks.
    model = P.SPECS_BY_ID["llama-gqa4x2-h64"].build()
    try:
        hf_longctx.enable_sequence_parallel(model, groups, ulysses_head_chunks=4)
    except ValueError as exc:
        results["error"] = str(exc)
    else:
        results["error"] = None
    configs = {name: {**config, "sp": world_size, "steps": 3} for name, config in TRAINER_CONFIGS.items()}
    results["trainer"] = U.trainer_worker(rank, world_size, out_dir, configs)
    return results


@pytest.fixture(scope="module")
def sp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = str(tmp_path_factory.mktemp("head_chunks_sp2"))
    return U.spawn_once(("head-chunks", 2), head_chunks_worker, 2, COMBOS, out_dir, timeout=SPAWN_TIMEOUT_S)


_refs: dict = {}


def _reference(spec_id: str, attn: str, case_name: str) -> tuple[float, dict[str, torch.Tensor]]:
    key = (spec_id, attn, case_name)
    if key not in _refs:
        model = SPECS[spec_id].build(P.reference_kernel(attn))
        loss, grads, _ = P.reference_loss_and_grads(model, P.make_case(case_name))
        _refs[key] = (loss, grads)
    return _refs[key]


@pytest.mark.parametrize("combo", [c for c in COMBOS if c[3] > 1], ids=lambda c: "-".join(map(str, c)))
def test_head_chunks_match_plain_ulysses_and_no_sp(combo, sp2, record_property):
    spec_id, attn, case_name, chunks, gc = combo
    ref_loss, ref_grads = _reference(spec_id, attn, case_name)
    got, plain = sp2[0][combo], sp2[0][(spec_id, attn, case_name, 1, gc)]
    worst = {}
    for name, run in (("chunks", got), ("plain", plain)):
        assert P.loss_error(run["loss"], ref_loss) <= P.LOSS_RTOL, (name, run["loss"], ref_loss)
        errors = P.grad_errors(run["grads"], ref_grads)
        assert len(errors) == len(ref_grads) and max(errors.values()) <= P.GRAD_RTOL, (name, max(errors.items()))
        worst[name] = max(errors.values())
    errors = P.grad_errors(got["grads"], plain["grads"])
    assert max(errors.values()) <= P.GRAD_RTOL
    # Both layers exchanged q/k/v and the output once per chunk, each exchange 1/chunks of the bytes
    # (kv heads sent with every chunk make the q/k/v exchanges a little larger, never smaller).
    for rank in sp2:
        run, base = rank[combo], rank[(spec_id, attn, case_name, 1, gc)]
        assert run["forward_a2a_calls"] == chunks * base["forward_a2a_calls"] == 2 * 2 * chunks
        assert run["forward_a2a_bytes"] >= base["forward_a2a_bytes"]
    record_property("max_rel_grad_diff", worst)


def test_invalid_chunk_count_is_refused_on_every_rank(sp2):
    for rank in sp2:
        assert rank["error"] is not None and "ulysses_head_chunks=4" in rank["error"] and "[1, 2]" in rank["error"]


@pytest.fixture(scope="module")
def trainer_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out_dir = str(tmp_path_factory.mktemp("head_chunks_ref"))
    configs = {"ref": {"gradient_checkpointing": True, "steps": 3}}
    return U.spawn_once(("head-chunks", 1), U.trainer_worker, 1, out_dir, configs, timeout=SPAWN_TIMEOUT_S)[0]["ref"]


@pytest.mark.parametrize("name", list(TRAINER_CONFIGS))
def test_trainer_with_head_chunks_matches_no_sp(name, sp2, trainer_reference, record_property):
    ref = trainer_reference
    assert len(ref["logs"]) == 3
    for rank in sp2:
        result = rank["trainer"][name]
        assert result["attn"].startswith("hf_longctx_ulysses"), result["attn"]
        worst = U.compare_logs(result["logs"], ref["logs"], ("loss", "grad_norm"), 1e-5)
        assert set(worst) == {"loss", "grad_norm"}
        if "flags" in TRAINER_CONFIGS[name]:
            assert all(result["memory"].values()), result["memory"]
    record_property("max_rel_diff", worst)

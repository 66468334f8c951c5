"""Model-level parity of the ring, hybrid and auto backends: the combinations and the spawned worker.

Reuses the Ulysses parity machinery (`_parity.py`: specs, batch cases, the hand-built SP=1
reference, SP step and DP-style gradient averaging). A combination is (options, spec, kernel, case);
options are `enable_sequence_parallel` keyword arguments. Each spawn loops over all of its world
size's combinations; rank 0 returns the averaged gradients, every rank its loss and what ran.
"""

from __future__ import annotations

import traceback

import torch
import torch.distributed as dist

import hf_longctx
from hf_longctx.data.layout import LAYOUT_KEY
from tests.dist import _parity as P

# 9 query / 3 kv heads (SmolLM2-135M's head layout) and 6 / 2 (auto picks hybrid 2 x 2 at SP=4).
NINE = P.ModelSpec("llama", 9, 3, 72, "gqa9x3")
SIX = P.ModelSpec("llama", 6, 2, 96, "gqa6x2")
SPECS = {**P.SPECS_BY_ID, NINE.id: NINE, SIX.id: SIX}


def _opts(backend: str, variant: str | None = None, layout: str = "zigzag", ulysses: int | None = None) -> tuple:
    return (("backend", backend), ("ring_variant", variant), ("ring_layout", layout), ("ulysses_degree", ulysses))


RING_P2P = _opts("ring", "p2p")
RING_AG = _opts("ring", "allgather")
RING_P2P_C = _opts("ring", "p2p", "contiguous")
RING_AG_C = _opts("ring", "allgather", "contiguous")
HYBRID = _opts("hybrid", "p2p", ulysses=2)
HYBRID_AG = _opts("hybrid", "allgather", ulysses=2)
AUTO = _opts("auto")

LLAMA_GQA, LLAMA_MHA, LLAMA_MQA = "llama-gqa4x2-h64", "llama-mha4x4-h64", "llama-mqa4x1-h64"
QWEN_GQA, QWEN_MQA, QWEN_MHA = "qwen3-gqa4x2-h128", "qwen3-mqa4x1-h128", "qwen3-mha4x4-h128"
MISTRAL_GQA, MISTRAL_MQA, MISTRAL_MHA = "mistral-gqa8x2-h256", "mistral-mqa4x1-h64", "mistral-mha4x4-h64"

COMBOS = {
    2: (
        (RING_P2P, LLAMA_GQA, "sdpa", "packed3"),
        (RING_P2P, MISTRAL_GQA, "sdpa", "padded_bs2"),
        (RING_P2P, NINE.id, "sdpa", "packed3"),
        (RING_P2P, "llama4-chunked4x2-h64", "sdpa", "packed3"),
        (RING_P2P, "deepseek_v3-mla4x4-h64", "sdpa", "seq37"),
        (RING_AG, LLAMA_MHA, "eager", "packed3"),
        (RING_AG, QWEN_GQA, "sdpa", "one_label"),
        (RING_AG, NINE.id, "sdpa", "completion_only"),
        (RING_P2P_C, MISTRAL_MQA, "sdpa", "packed3"),
        (RING_P2P_C, LLAMA_GQA, "sdpa", "one_label"),
        (RING_AG_C, QWEN_MHA, "sdpa", "seq37"),
        (AUTO, NINE.id, "sdpa", "packed3"),
        (AUTO, NINE.id, "sdpa", "one_label"),
        (AUTO, LLAMA_GQA, "sdpa", "packed3"),
    ),
    4: (
        (RING_P2P, LLAMA_GQA, "sdpa", "packed3"),
        (RING_P2P, QWEN_MQA, "sdpa", "one_label"),
        (RING_AG, MISTRAL_GQA, "sdpa", "packed3"),
        (RING_AG_C, QWEN_GQA, "sdpa", "seq37"),
        (HYBRID, LLAMA_GQA, "sdpa", "packed3"),
        (HYBRID, QWEN_MQA, "sdpa", "one_label"),
        (HYBRID, "llama-gqa_irregular12x3-h192", "sdpa", "packed3"),
        (HYBRID_AG, SIX.id, "sdpa", "padded_bs2"),
        (AUTO, NINE.id, "sdpa", "packed3"),
        (AUTO, SIX.id, "sdpa", "packed3"),
        (AUTO, LLAMA_MQA, "sdpa", "one_label"),
    ),
}
# What auto must pick: (world, spec) -> (backend, ulysses degree); ranks per node = world (one host).
AUTO_EXPECTED = {
    (2, NINE.id): ("ring", 1),
    (2, LLAMA_GQA): ("ulysses", 2),
    (4, NINE.id): ("ring", 1),
    (4, SIX.id): ("hybrid", 2),
    (4, LLAMA_MQA): ("ulysses", 4),
}


def combo_id(combo: tuple) -> str:
    opts = dict(combo[0])
    name = "-".join(str(v) for v in (opts["backend"], opts["ring_variant"], opts["ulysses_degree"]) if v)
    layout = "" if opts["backend"] == "auto" else f"-{opts['ring_layout']}"
    return f"{name}{layout}-{combo[1]}-{combo[2]}-{combo[3]}"


def parity_worker(rank: int, world_size: int, combos: tuple) -> dict:
    """Run every combination at SP=world_size (checkpointed layers for one in three models)."""
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    results: dict = {}
    for i, (opts, spec_id, attn, case_name) in enumerate(combos):
        model = SPECS[spec_id].build(attn)
        if i % 3 == 2:  # the forward is replayed in backward: no state may leak between the two
            model.activation_checkpointing_enable({"use_reentrant": False})
        with hf_longctx.enable_sequence_parallel(model, groups, **dict(opts)) as handle:
            case = P.make_case(case_name)
            loss, shift_labels = P._sp_step(model, case.batch, groups)
            masked = torch.tensor([int(bool((shift_labels == P.IGNORE).all()))])
            dist.all_reduce(masked, group=groups.sp_group)
            grads = P._averaged_grads(model, groups)
            layout = groups.layout
        results[(opts, spec_id, attn, case_name)] = {
            "loss": loss.item(),
            "grads": grads if rank == 0 else None,
            "backend": (handle.backend.name, handle.backend.ulysses_degree),
            "layout": layout,
            "layout_after": groups.layout,
            "masked_ranks": int(masked),
        }
    return results


def _mismatch_checks(groups) -> dict:
    """Layout agreement errors: a zigzag shard into a Ulysses model, two layouts on one groups object."""
    out: dict = {}
    batch = P.make_case("seq37").batch
    ring_model, ulysses_model = P.ISOLATION_SPEC.build(), P.ISOLATION_SPEC.build()
    with hf_longctx.enable_sequence_parallel(ring_model, groups, backend="ring"):
        shard = hf_longctx.shard_batch(batch, groups)
        out["shard_layout"] = shard.get(LAYOUT_KEY)
        try:
            hf_longctx.enable_sequence_parallel(ulysses_model, groups)
        except ValueError as exc:
            out["second_layout"] = str(exc)
    with hf_longctx.enable_sequence_parallel(ulysses_model, groups):
        shard.pop("shift_labels")
        try:
            ulysses_model(**shard)
        except ValueError as exc:
            out["zigzag_into_ulysses"] = str(exc)
    return out


def _refusals(groups) -> dict:
    """Models the ring cannot make exact are refused at enable time, naming sp_backend="ulysses"."""
    out = {}
    for name, (spec, attn) in {
        "softcap": ("gemma2-softcap4x2-h64", "eager"),
        "sinks": ("gpt_oss-sinks4x2-h64", "eager"),
    }.items():
        try:
            hf_longctx.enable_sequence_parallel(P.SPECS_BY_ID[spec].build(attn), groups, backend="ring")
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def features_worker(rank: int, world_size: int) -> dict:
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    out = {}
    for name, check in (("mismatch", _mismatch_checks), ("refusals", _refusals)):
        try:
            out[name] = check(groups)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that test
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out

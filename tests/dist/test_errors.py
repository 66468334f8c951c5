"""Clear failures under SP: bad configuration or a rank desync raises a `ValueError` on every rank.

One world-2 spawn runs every scenario in order (each raises before, or right after, the one small
all-gather, so the ranks stay in step); each worker catches the expected exception and returns its
message, and the parent asserts on every rank's message and on the collectives hf_longctx issued before the
raise (at most that one all-gather: counted, not timed). A hang fails through the spawn timeout.
"""

from __future__ import annotations

import re

import pytest
import torch

import hf_longctx
from tests._dist import run_distributed, value_errors
from tests._models import tiny_model

WORLD_SIZE = 2
SPAWN_TIMEOUT_S = 60


def _batch(seq_len: int = 9, batch_size: int = 1, offset: int = 0) -> dict[str, torch.Tensor]:
    ids = (torch.arange(batch_size * seq_len).reshape(batch_size, seq_len) * 7 + offset) % 100 + 1
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _desync_batch(rank: int, kind: str) -> dict[str, torch.Tensor]:
    """Rank 0 holds the reference batch; rank 1 a batch differing in one property."""
    if rank == 0:
        return _batch()
    if kind == "seq_len":
        return _batch(seq_len=8)
    if kind == "batch_size":
        return _batch(batch_size=2)
    if kind == "tokens":
        return _batch(offset=1)
    if kind == "dtype":
        batch = _batch()
        batch["attention_mask"] = batch["attention_mask"].to(torch.int32)
        return batch
    raise ValueError(kind)


def _scenarios(rank: int, world_size: int) -> dict:
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    return {
        "build_3": lambda: hf_longctx.SequenceParallelGroups.build(3),
        "build_0": lambda: hf_longctx.SequenceParallelGroups.build(0),
        **{
            f"desync_{kind}": (lambda kind=kind: hf_longctx.shard_batch(_desync_batch(rank, kind), groups))
            for kind in ("seq_len", "batch_size", "tokens", "dtype")
        },
        "heads": lambda: hf_longctx.enable_sequence_parallel(
            tiny_model("llama", num_heads=3, num_kv_heads=3, hidden=48), groups
        ),
        "backend": lambda: hf_longctx.enable_sequence_parallel(tiny_model("llama"), groups, backend="nope"),
    }


SCENARIOS = (
    "build_3",
    "build_0",
    "desync_seq_len",
    "desync_batch_size",
    "desync_tokens",
    "desync_dtype",
    "heads",
    "backend",
)


def errors_worker(rank: int, world_size: int) -> dict:
    """Run each scenario; record the ValueError message (or that none was raised) and the collectives issued."""
    scenarios = _scenarios(rank, world_size)
    assert tuple(scenarios) == SCENARIOS
    # Still in step after each failure: a later collective completes on both ranks.
    out = value_errors(scenarios, after_each=torch.distributed.barrier)
    # Nothing was left behind by the failed enables.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out["sp_keys_left"] = [k for k in ALL_ATTENTION_FUNCTIONS.keys() if k.startswith("hf_longctx")]
    return out


_cache: dict[str, object] = {}


def _messages(name: str) -> list[str]:
    """Each rank's ValueError message for scenario `name` (one spawn for the whole module)."""
    if "results" not in _cache:
        try:
            _cache["results"] = run_distributed(errors_worker, WORLD_SIZE, timeout=SPAWN_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - re-raised for every dependent test
            _cache["results"] = exc
    results = _cache["results"]
    if isinstance(results, Exception):
        raise results
    messages = []
    for rank, result in enumerate(results):
        entry = result[name]
        assert entry["message"] is not None, f"rank {rank}: {name} raised no ValueError"
        # Raised before, or right after, the one small all-gather: nothing else ran, nothing could hang.
        assert entry["collectives"] in ({}, {"all_gather": 1}), f"rank {rank}: {name} issued {entry['collectives']}"
        assert result["sp_keys_left"] == []
        messages.append(entry["message"])
    return messages


def _differing_fields(message: str) -> set[str]:
    """The fields named as differing in shard_batch's desync message: '(a, b differ; ...'."""
    match = re.search(r"\(([^;()]*) differ;", message)
    assert match, message
    return {field.strip() for field in match.group(1).split(",")}


def test_build_sp_size_not_dividing_world_raises_on_every_rank():
    for message in _messages("build_3"):
        assert "sp_size=3" in message
        assert "world size 2" in message
        assert "[1, 2]" in message


def test_build_sp_size_zero_raises_on_every_rank():
    for message in _messages("build_0"):
        assert "sp_size must be an integer >= 1" in message
        assert "0" in message


@pytest.mark.parametrize(
    ("scenario", "field"),
    [
        ("desync_seq_len", "sequence length"),
        ("desync_batch_size", "batch size"),
        ("desync_tokens", "input_ids checksum"),
        ("desync_dtype", "keys/dtypes/shapes"),
    ],
)
def test_shard_batch_desync_raises_on_every_rank_naming_the_field(scenario, field):
    for message in _messages(scenario):
        assert "Sequence-parallel ranks hold different batches" in message
        assert "same samples" in message
        assert field in _differing_fields(message)


def test_shard_batch_desync_names_only_what_differs():
    # Same shapes, other tokens: only the checksum; another dtype, same tokens: only the layout.
    for message in _messages("desync_tokens"):
        assert _differing_fields(message) == {"input_ids checksum"}
    for message in _messages("desync_dtype"):
        assert _differing_fields(message) == {"keys/dtypes/shapes"}
        assert "dtypes" in message
    for message in _messages("desync_batch_size"):
        assert "sequence length" not in _differing_fields(message)
    for message in _messages("desync_seq_len"):
        assert "batch size" not in _differing_fields(message)


def test_heads_not_divisible_lists_valid_sp_sizes():
    for message in _messages("heads"):
        assert "num_attention_heads (3)" in message
        assert "sp_size (2)" in message
        assert "valid sp_size values for this model: [1, 3]" in message


def test_unknown_backend_raises_on_every_rank():
    for message in _messages("backend"):
        assert "Unknown sequence-parallel backend 'nope'" in message
        assert "ulysses" in message

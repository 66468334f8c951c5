"""Bad inputs fail before any attention collective, with a `ValueError` on every rank naming the culprit.

One SP=2 launch runs every scenario in order (each raises on both ranks at the same point, so they stay in
step; a barrier after each proves it): through the library (`shard_batch` + the model's forward) a token id
outside the vocabulary (too large, or a -100 label value in `input_ids`), a position past
`max_position_embeddings`, an `attention_mask` whose shape disagrees with `input_ids`, an empty batch, shards in
the other token layout than the attention's (contiguous, tagged or not, into a zigzag ring; zigzag into Ulysses;
one rank's shard only); through the Trainer, token ids outside the vocabulary, an empty training set and an
empty eval set.

A gradient-accumulation window whose labels are all -100 must give loss 0, zero gradients and no NaN
(transformers' losses divide the zero sum by num_items_in_batch = 0: a NaN loss, which the Trainer's default
`logging_nan_inf_filter` hides from the logs): Trainer at SP=2 on windows A, empty, B (sequential sampler, SGD)
against Trainer at SP=1 on A, B, where the empty window's step is simply absent.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

import hf_longctx
from hf_longctx.data.collator import SequenceShardingCollator
from hf_longctx.data.layout import LAYOUT_KEY
from tests import _faults
from tests._dist import value_errors
from tests._models import tiny_model
from tests.dist import _trainer_utils as U

# Counted from when both ranks are forked (the forkserver's imports, 12-95 s at load 4-33 on 2 cores, come first).
LAUNCH_TIMEOUT_S = 180
# A rank stuck in a collective its peer left ends only at the group timeout, with a RuntimeError: every scenario
# that raised a ValueError on both ranks, the barrier after it completing, failed fast. That it failed before the
# attention ran is counted (the attention collectives hf_longctx issued in the scenario), not timed.
PG_TIMEOUT_S = 60.0
ATTENTION_OPS = {"all_to_all", "ring_p2p", "ring_all_gather", "ring_reduce_scatter"}
LIMIT = 15  # max_position_embeddings of the position scenarios


def _ids(n: int, *, bad_at: int | None = None, bad: int = 0) -> torch.Tensor:
    ids = (torch.arange(n) * 7) % 100 + 1
    if bad_at is not None:
        ids[bad_at] = bad
    return ids.unsqueeze(0)


def _forward(model, groups, batch) -> None:
    shard = hf_longctx.shard_batch(batch, groups)
    shard.pop("shift_labels")
    model(**shard)


def _library_scenarios(groups) -> dict:
    model = tiny_model("llama")
    hf_longctx.enable_sequence_parallel(model, groups)
    short = tiny_model("llama")
    short.config.max_position_embeddings = LIMIT  # read when SP is enabled
    hf_longctx.enable_sequence_parallel(short, groups)

    def batch(ids, mask=None):
        mask = torch.ones_like(ids) if mask is None else mask
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": mask}

    # Position 19 sits in rank 1's half of the 20 tokens; rank 0 must raise all the same.
    packed_positions = torch.cat([torch.arange(10), torch.arange(10)]).unsqueeze(0)
    return {
        **_layout_scenarios(groups, model, batch(_ids(20))),
        "vocab_high": lambda: _forward(model, groups, batch(_ids(20, bad_at=15, bad=200))),
        "vocab_negative": lambda: _forward(model, groups, batch(_ids(20, bad_at=3, bad=-100))),
        "too_long": lambda: _forward(short, groups, batch(_ids(20))),
        # Valid: 15 tokens reach position 14; SP pads to 16, but the padding's position 15 is not a token.
        "at_limit": lambda: _forward(short, groups, batch(_ids(LIMIT))),
        # Valid: two packed documents of 10 tokens restart their positions.
        "packed": lambda: _forward(short, groups, {**batch(_ids(20)), "position_ids": packed_positions}),
        "mask_shape": lambda: _forward(model, groups, batch(_ids(20), torch.ones(1, 19, dtype=torch.long))),
        "empty_batch": lambda: _forward(model, groups, batch(_ids(0))),
    }


def _layout_scenarios(groups, ulysses_model, batch: dict) -> dict:
    """Shards in the other token layout than the model's attention, either way (a plausible loss, wrong gradients)."""
    ring_groups = hf_longctx.SequenceParallelGroups.build(groups.sp_world_size)
    ring = tiny_model("llama")
    hf_longctx.enable_sequence_parallel(ring, ring_groups, backend="ring")  # zigzag
    ring_contiguous = tiny_model("llama")
    hf_longctx.enable_sequence_parallel(ring_contiguous, groups, backend="ring", ring_layout="contiguous")
    contiguous = hf_longctx.shard_batch(batch, groups)  # the Ulysses groups: contiguous
    zigzag = hf_longctx.shard_batch(batch, ring_groups)
    untagged = {k: v for k, v in contiguous.items() if k != LAYOUT_KEY}  # a custom loop's slices
    collated = SequenceShardingCollator(lambda rows: rows[0], groups.sp_rank, groups.sp_world_size)([batch])
    mixed = zigzag if groups.sp_rank == 0 else untagged
    return {
        "contiguous_into_ring": lambda: _call(ring, contiguous),
        "untagged_into_ring": lambda: _call(ring, untagged),
        "collated_contiguous_into_ring": lambda: _call(ring, collated),
        "mixed_into_ring": lambda: _call(ring, mixed),
        "zigzag_into_ulysses": lambda: _call(ulysses_model, zigzag),
        # Valid: a contiguous ring takes a custom loop's contiguous slices; the zigzag ring takes shard_batch's.
        "untagged_into_contiguous_ring": lambda: _call(ring_contiguous, untagged),
        "zigzag_into_ring": lambda: _call(ring, zigzag),
    }


def _call(model, shard: dict) -> None:
    model(**{k: v for k, v in shard.items() if k not in ("shift_labels", "labels")})


def _trainer(out_dir: str, train, *, sampling: str = "random", steps: int = 2):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=steps,
        save_strategy="no",
        remove_unused_columns=False,
        train_sampling_strategy=sampling,
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=2),
    )
    return Trainer(model=tiny_model("llama"), args=args, train_dataset=train, data_collator=U.RecordingCollator())


def _rows(n: int, bad_token: int | None = None):
    import datasets

    rows = U.make_rows("mixed", n)
    if bad_token is not None:
        rows[1]["input_ids"][-1] = bad_token
    return datasets.Dataset.from_list(rows)


def _trainer_scenarios(out_dir: str) -> dict:
    empty = _rows(4).select([])
    return {
        "trainer_vocab": lambda: _trainer(out_dir, _rows(8, bad_token=128), sampling="sequential").train(),
        "trainer_empty_train_sequential": lambda: _trainer(out_dir, empty, sampling="sequential").train(),
        # The default random sampler refuses an empty dataset itself (torch: num_samples=0), before any collective.
        "trainer_empty_train_random": lambda: _trainer(out_dir, empty).train(),
        "trainer_empty_eval": lambda: _trainer(out_dir, _rows(8)).evaluate(empty),
    }


def bad_inputs_worker(rank: int, world_size: int, out_dir: str) -> dict:
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    scenarios = {**_library_scenarios(groups), **_trainer_scenarios(out_dir)}
    # Both ranks raised at the same point: a collective after each scenario still completes.
    return value_errors(scenarios, after_each=torch.distributed.barrier)


def single_case_worker(rank: int, world_size: int, out_dir: str, name: str) -> None:
    """One scenario as its own job, its ValueError left to end the rank (`scripts/bad_input_sweep.py`)."""
    import os

    with open(os.path.join(out_dir, f"start-rank{rank}"), "w") as f:
        f.write(repr(time.time()))
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    scenarios = {**_library_scenarios(groups), **_trainer_scenarios(out_dir)}
    scenarios[name]()


_cache: dict = {}


def _messages(name: str, tmp_path_factory) -> list[str | None]:
    if "bad" not in _cache:
        out_dir = str(tmp_path_factory.mktemp("bad_inputs"))
        _cache["bad"] = _faults.launch(
            bad_inputs_worker, 2, out_dir, timeout=LAUNCH_TIMEOUT_S, pg_timeout_s=PG_TIMEOUT_S
        )
    outcomes = _cache["bad"]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    messages = []
    for outcome in outcomes:
        entry = outcome.result[name]
        attention = ATTENTION_OPS & set(entry["collectives"])
        # A bad input raises before any attention collective; a valid one runs the attention.
        assert bool(attention) == (entry["message"] is None), (outcome.rank, name, entry)
        messages.append(entry["message"])
    return messages


@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("vocab_high", ["token id 200 (in SP rank 1's shard)", "128 embedding rows", "resize_token_embeddings"]),
        ("vocab_negative", ["token id -100 (in SP rank 0's shard)", "-100 into input_ids"]),
        ("too_long", ["reaches position 19", f"supports {LIMIT} positions", "max_length"]),
        ("mask_shape", ["attention_mask has shape (1, 19) but input_ids has (1, 20)"]),
        ("empty_batch", ["The batch is empty (1 rows x 0 tokens)"]),
        (
            "contiguous_into_ring",
            [
                "ring attention expects 'zigzag'",
                "SP rank shards are {0: 'contiguous', 1: 'contiguous'}",
                "hf_longctx.shard_batch(batch, groups)",
                'ring_layout="contiguous"',
            ],
        ),
        ("untagged_into_ring", ["expects 'zigzag'", f"SP ranks [0, 1]: no {LAYOUT_KEY!r} key", "ring_layout"]),
        ("collated_contiguous_into_ring", ["expects 'zigzag'", "{0: 'contiguous', 1: 'contiguous'}"]),
        ("mixed_into_ring", ["expects 'zigzag'", "{0: 'zigzag', 1: 'contiguous'}", "SP ranks [1]: no"]),
        ("zigzag_into_ulysses", ["ulysses attention expects 'contiguous'", "shard_batch", 'ring_layout="zigzag"']),
        ("trainer_vocab", ["token id 128", "128 embedding rows"]),
        ("trainer_empty_train_sequential", ["The DataLoader yields no batch: its dataset has 0 rows"]),
        ("trainer_empty_train_random", ["num_samples=0"]),
        ("trainer_empty_eval", ["The DataLoader yields no batch: its dataset has 0 rows"]),
    ],
)
def test_bad_input_raises_on_every_rank_naming_the_culprit(scenario, expected, tmp_path_factory, record_property):
    messages = _messages(scenario, tmp_path_factory)
    record_property("collectives", [o.result[scenario]["collectives"] for o in _cache["bad"]])
    assert len(messages) == 2
    for message in messages:
        assert message is not None, f"{scenario}: no ValueError"
        for text in expected:
            assert text in message, (text, message)
    record_property("errors", {scenario: sorted({m.splitlines()[0][:90] for m in messages})})


@pytest.mark.parametrize("scenario", ["at_limit", "packed", "untagged_into_contiguous_ring", "zigzag_into_ring"])
def test_valid_positions_at_the_limit_pass(scenario, tmp_path_factory):
    assert _messages(scenario, tmp_path_factory) == [None, None]


# ---- a gradient-accumulation window without labels ------------------------------------------------


def _window_rows(with_empty: bool):
    """Windows of 4 rows (batch 2 x accumulation 2): A, [all labels -100], B; or A, B."""
    import datasets

    rows = U.make_rows("mixed", 12)
    for row in rows[4:8]:
        row["labels"] = [U.IGNORE] * len(row["labels"])
    keep = rows if with_empty else rows[:4] + rows[8:]
    return datasets.Dataset.from_list(keep)


def masked_window_job(rank: int, world_size: int, out_dir: str) -> list[dict]:
    from transformers import Trainer, TrainingArguments

    sp = world_size
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3 if sp > 1 else 2,
        optim="sgd",
        learning_rate=U.LR["sgd"],
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
        # Log a NaN loss as NaN (by default Trainer logs the window's average instead).
        logging_nan_inf_filter=False,
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=sp) if sp > 1 else None,
    )
    model = tiny_model("llama")
    trainer = Trainer(model=model, args=args, train_dataset=_window_rows(sp > 1), data_collator=U.RecordingCollator())
    trainer.train()
    return U.logged_steps(trainer, ("loss", "grad_norm"))


def test_window_without_labels_gives_zero_loss_and_gradients(tmp_path, record_property):
    sp = _faults.launch(masked_window_job, 2, str(tmp_path / "sp2"), timeout=LAUNCH_TIMEOUT_S)
    ref = _faults.launch(masked_window_job, 1, str(tmp_path / "ref"), timeout=LAUNCH_TIMEOUT_S)
    assert all(o.ok for o in sp + ref), [o.error for o in sp + ref]

    (want_a, want_b) = ref[0].result
    for outcome in sp:
        got_a, empty, got_b = outcome.result
        assert empty["loss"] == 0.0 and empty["grad_norm"] == 0.0, empty
        assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in outcome.result)
        # SGD with zero gradients leaves the weights alone: B trains from where A left them, as without the window.
        for got, want in ((got_a, want_a), (got_b, want_b)):
            for key in ("loss", "grad_norm"):
                assert U.rel_diff(got[key], want[key]) <= 1e-5, (key, got, want)
    record_property("outcome", {"loss": empty["loss"], "grad_norm": empty["grad_norm"], "ranks": len(sp)})

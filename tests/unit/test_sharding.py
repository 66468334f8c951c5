"""Pure batch sharding (`hf_longctx.data.sharding`), looping over SP ranks in one process.

Expected shards are written out literally for tiny batches; a hypothesis property test checks
that the shards of all ranks tile a padded global batch built by an independent reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_longctx import IGNORE_INDEX, SequenceParallelGroups, shard_batch
from hf_longctx.data.sharding import make_shift_labels, prepare_global_batch, shard_batch_for_rank

X = IGNORE_INDEX


def t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def shards(batch: dict, world: int, **kwargs) -> list[dict]:
    return [shard_batch_for_rank(batch, rank, world, **kwargs) for rank in range(world)]


def assert_batch_equal(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        got = actual[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype, key
            assert torch.equal(got, value), f"{key}: {got.tolist()} != {value.tolist()}"
        else:
            assert got == value, key


# ---------------------------------------------------------------------------------------------
# Hand-written expected shards
# ---------------------------------------------------------------------------------------------


def test_one_row_of_six_at_sp2():
    batch = {
        "input_ids": t([[10, 11, 12, 13, 14, 15]]),
        "attention_mask": t([[1, 1, 1, 1, 1, 1]]),
        "labels": t([[X, X, 12, 13, 14, 15]]),
    }
    expected = [
        {
            "input_ids": t([[10, 11, 12]]),
            "attention_mask": t([[1, 1, 1]]),
            "position_ids": t([[0, 1, 2]]),
            # position 2 predicts token 13, which lives on rank 1: the label stays on rank 0.
            "shift_labels": t([[X, 12, 13]]),
        },
        {
            "input_ids": t([[13, 14, 15]]),
            "attention_mask": t([[1, 1, 1]]),
            "position_ids": t([[3, 4, 5]]),
            "shift_labels": t([[14, 15, X]]),
        },
    ]
    for rank, shard in enumerate(shards(batch, 2)):
        assert_batch_equal(shard, expected[rank])


def test_two_right_padded_rows_of_five_at_sp2_pad_to_six():
    # Labels copy input_ids, pads included: only the attention mask tells where padding starts.
    batch = {
        "input_ids": t([[1, 2, 3, 4, 5], [6, 7, 8, 99, 99]]),
        "attention_mask": t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "labels": t([[1, 2, 3, 4, 5], [6, 7, 8, 99, 99]]),
    }
    expected = [
        {
            "input_ids": t([[1, 2, 3], [6, 7, 8]]),
            "attention_mask": t([[1, 1, 1], [1, 1, 1]]),
            "position_ids": t([[0, 1, 2], [0, 1, 2]]),
            "shift_labels": t([[2, 3, 4], [7, 8, X]]),
        },
        {
            "input_ids": t([[4, 5, 99], [99, 99, 99]]),
            "attention_mask": t([[1, 1, 0], [0, 0, 0]]),
            "position_ids": t([[3, 4, 5], [3, 4, 5]]),
            "shift_labels": t([[5, X, X], [X, X, X]]),
        },
    ]
    for rank, shard in enumerate(shards(batch, 2, pad_token_id=99)):
        assert_batch_equal(shard, expected[rank])


def test_packed_row_documents_end_with_ignore_index():
    # Three documents of lengths 3, 2, 1 in one row (padding-free packing).
    batch = {
        "input_ids": t([[10, 11, 12, 13, 14, 15]]),
        "position_ids": t([[0, 1, 2, 0, 1, 0]]),
        "labels": t([[10, 11, 12, 13, 14, 15]]),
    }
    expected = [
        {"input_ids": t([[10, 11, 12]]), "position_ids": t([[0, 1, 2]]), "shift_labels": t([[11, 12, X]])},
        {"input_ids": t([[13, 14, 15]]), "position_ids": t([[0, 1, 0]]), "shift_labels": t([[14, X, X]])},
    ]
    for rank, shard in enumerate(shards(batch, 2)):
        assert_batch_equal(shard, expected[rank])


def test_padding_of_packed_row_continues_last_document_positions():
    batch = {
        "input_ids": t([[10, 11, 12, 13, 14]]),
        "position_ids": t([[0, 1, 0, 1, 2]]),
        "labels": t([[10, 11, 12, 13, 14]]),
    }
    expected = [
        {"input_ids": t([[10, 11]]), "position_ids": t([[0, 1]]), "shift_labels": t([[11, X]])},
        {"input_ids": t([[12, 13]]), "position_ids": t([[0, 1]]), "shift_labels": t([[13, 14]])},
        {"input_ids": t([[14, 7]]), "position_ids": t([[2, 3]]), "shift_labels": t([[X, X]])},
    ]
    for rank, shard in enumerate(shards(batch, 3, pad_token_id=7)):
        assert_batch_equal(shard, expected[rank])


def test_cu_seq_lens_rebuild_position_ids_and_are_dropped():
    batch = {
        "input_ids": t([[10, 11, 12, 13, 14, 15]]),
        "labels": t([[10, 11, 12, 13, 14, 15]]),
        "cu_seq_lens_q": torch.tensor([0, 3, 5, 6], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, 3, 5, 6], dtype=torch.int32),
        "max_length_q": 3,
        "max_length_k": 3,
    }
    expected = [
        {"input_ids": t([[10, 11, 12]]), "position_ids": t([[0, 1, 2]]), "shift_labels": t([[11, 12, X]])},
        {"input_ids": t([[13, 14, 15]]), "position_ids": t([[0, 1, 0]]), "shift_labels": t([[14, X, X]])},
    ]
    for rank, shard in enumerate(shards(batch, 2)):
        assert_batch_equal(shard, expected[rank])
    # DataCollatorWithFlattening(return_seq_idx=True, return_position_ids=False) describes the same row by seq_idx.
    by_seq_idx = {k: batch[k] for k in ("input_ids", "labels")} | {"seq_idx": t([[0, 0, 0, 1, 1, 2]])}
    for rank, shard in enumerate(shards(by_seq_idx, 2)):
        assert_batch_equal(shard, expected[rank])


def test_given_shift_labels_are_used_as_is_and_labels_removed():
    given_shift = t([[5, 6, 7, 8, 9]])  # deliberately not a shift of `labels`
    batch = {
        "input_ids": t([[1, 2, 3, 4, 5]]),
        "labels": t([[1, 2, 3, 4, 5]]),
        "shift_labels": given_shift,
    }
    out = shards(batch, 2)
    assert all("labels" not in s for s in out)
    assert torch.equal(out[0]["shift_labels"], t([[5, 6, 7]]))
    assert torch.equal(out[1]["shift_labels"], t([[8, 9, X]]))  # padded with IGNORE_INDEX
    assert torch.equal(given_shift, t([[5, 6, 7, 8, 9]]))


def test_no_labels_means_no_shift_labels():
    out = shards({"input_ids": t([[1, 2, 3, 4]])}, 2)
    assert all(sorted(s) == ["input_ids", "position_ids"] for s in out)


# ---------------------------------------------------------------------------------------------
# make_shift_labels on its own
# ---------------------------------------------------------------------------------------------


def test_make_shift_labels_cuts_at_last_position_document_ends_and_padding():
    labels = t([[1, 2, 3, 4, 5, 6, 7, 8]])
    position_ids = t([[0, 1, 2, 0, 1, 2, 3, 4]])
    mask = t([[1, 1, 1, 1, 1, 1, 0, 0]])
    assert make_shift_labels(labels, position_ids).tolist() == [[2, 3, X, 5, 6, 7, 8, X]]
    assert make_shift_labels(labels, position_ids, mask).tolist() == [[2, 3, X, 5, 6, X, X, X]]


def test_make_shift_labels_keeps_existing_ignore_index():
    labels = t([[1, X, X, 4, 5]])
    assert make_shift_labels(labels, t([[0, 1, 2, 3, 4]])).tolist() == [[X, X, 4, 5, X]]


# ---------------------------------------------------------------------------------------------
# Tensor kinds
# ---------------------------------------------------------------------------------------------


def test_inputs_embeds_sliced_on_dim1_and_zero_padded():
    embeds = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3) + 1.0
    out = shards({"inputs_embeds": embeds}, 2)
    padded = torch.cat([embeds, torch.zeros(2, 1, 3)], dim=1)
    assert out[0]["inputs_embeds"].shape == (2, 3, 3)
    assert torch.equal(out[0]["inputs_embeds"], padded[:, :3])
    assert torch.equal(out[1]["inputs_embeds"], padded[:, 3:])
    assert torch.equal(out[1]["position_ids"], t([[3, 4, 5], [3, 4, 5]]))


def test_non_sequence_entries_pass_through_untouched():
    other = torch.arange(7)
    image_sizes = torch.ones(2, 3)
    batch = {
        "input_ids": t([[1, 2, 3, 4], [5, 6, 7, 8]]),
        "num_items_in_batch": 11,
        "source": "shakespeare",
        "other": other,
        "image_sizes": image_sizes,
    }
    for shard in shards(batch, 2):
        assert shard["num_items_in_batch"] == 11
        assert shard["source"] == "shakespeare"
        assert shard["other"] is other
        assert shard["image_sizes"] is image_sizes
    assert torch.equal(other, torch.arange(7))


def test_left_padding_raises_naming_padding_side():
    batch = {"input_ids": t([[0, 0, 1, 2]]), "attention_mask": t([[0, 0, 1, 1]])}
    with pytest.raises(ValueError, match="padding_side"):
        shard_batch_for_rank(batch, 0, 2)


def test_inner_padding_raises():
    batch = {"input_ids": t([[1, 0, 1, 2]]), "attention_mask": t([[1, 0, 1, 1]])}
    with pytest.raises(ValueError, match="padding_side"):
        shard_batch_for_rank(batch, 0, 2)


def test_four_dim_attention_mask_raises():
    batch = {"input_ids": t([[1, 2, 3, 4]]), "attention_mask": torch.ones(1, 1, 4, 4)}
    with pytest.raises(ValueError, match="attention_mask must be 2-D"):
        shard_batch_for_rank(batch, 0, 2)


def test_missing_input_ids_and_embeds_raises():
    with pytest.raises(ValueError, match="input_ids"):
        shard_batch_for_rank({"labels": t([[1, 2]])}, 0, 2)


@pytest.mark.parametrize("rank", [-1, 2])
def test_rank_out_of_range_raises(rank):
    with pytest.raises(ValueError, match="sp_rank"):
        shard_batch_for_rank({"input_ids": t([[1, 2]])}, rank, 2)


@pytest.mark.parametrize(
    ("world", "position_ids"),
    [(1, None), (2, None), (3, None), (2, t([[0, 1, 2, 0, 1, 2]])), (4, t([[0, 1, 2, 0, 1, 2]]))],
    ids=["sp1", "sp2", "sp3", "sp2-packed", "sp4-packed-padded"],
)
def test_shards_are_contiguous_copies(world, position_ids):
    batch = {
        "input_ids": t([[10, 11, 12, 13, 14, 15]]),
        "attention_mask": t([[1, 1, 1, 1, 1, 1]]),
        "labels": t([[10, 11, 12, 13, 14, 15]]),
        "inputs_embeds": torch.arange(18, dtype=torch.float32).reshape(1, 6, 3),
    }
    if position_ids is not None:
        batch["position_ids"] = position_ids
    before = {k: v.clone() for k, v in batch.items()}
    for shard in shards(batch, world):
        for key, value in shard.items():
            assert value.is_contiguous(), key
            value.fill_(-7)
    for key, value in batch.items():
        assert torch.equal(value, before[key]), f"mutating a shard changed the input's {key}"


def test_shard_batch_with_single_groups_equals_rank0_of_one():
    batch = {"input_ids": t([[1, 2, 3]]), "labels": t([[1, 2, 3]])}
    out = shard_batch(batch, SequenceParallelGroups.single())
    assert_batch_equal(out, shard_batch_for_rank(batch, 0, 1))


# ---------------------------------------------------------------------------------------------
# Property test: shards tile an independently built padded global batch
# ---------------------------------------------------------------------------------------------


def _reference_global(ids, labels, pos, mask, world, pad_id):
    """Padded global batch by plain python loops (no library code)."""
    sl = len(ids[0])
    padded = -(-sl // world) * world
    ref = {"input_ids": [], "position_ids": [], "shift_labels": [], "attention_mask": []}
    for b in range(len(ids)):
        shift = []
        for i in range(sl):
            last = i == sl - 1
            if last or pos[b][i + 1] == 0 or (mask is not None and mask[b][i + 1] == 0):
                shift.append(X)
            else:
                shift.append(labels[b][i + 1])
        extra = padded - sl
        ref["input_ids"].append(ids[b] + [pad_id] * extra)
        ref["position_ids"].append(pos[b] + [pos[b][-1] + k for k in range(1, extra + 1)])
        ref["shift_labels"].append(shift + [X] * extra)
        if mask is not None:
            ref["attention_mask"].append(mask[b] + [0] * extra)
    if mask is None:
        del ref["attention_mask"]
    return {k: t(v) for k, v in ref.items()}


@st.composite
def packed_batches(draw):
    bs = draw(st.integers(1, 3))
    sl = draw(st.integers(1, 40))
    use_mask = draw(st.booleans())
    ids, labels, pos, mask = [], [], [], []
    for _ in range(bs):
        real = draw(st.integers(1, sl)) if use_mask else sl
        starts = {0} | set(draw(st.lists(st.integers(0, real - 1), max_size=6)))
        row_pos, p = [], 0
        for i in range(sl):
            p = 0 if i in starts else p + 1
            row_pos.append(p)
        pos.append(row_pos)
        ids.append(draw(st.lists(st.integers(1, 50), min_size=sl, max_size=sl)))
        labels.append([X if draw(st.integers(0, 4)) == 0 else v for v in ids[-1]])
        mask.append([1] * real + [0] * (sl - real))
    return ids, labels, pos, (mask if use_mask else None)


@settings(max_examples=150, deadline=None)
@given(data=packed_batches(), world=st.sampled_from([1, 2, 3, 4]))
def test_shards_concatenate_to_padded_global_batch(data, world):
    ids, labels, pos, mask = data
    batch = {"input_ids": t(ids), "labels": t(labels), "position_ids": t(pos)}
    if mask is not None:
        batch["attention_mask"] = t(mask)
    ref = _reference_global(ids, labels, pos, mask, world, pad_id=0)
    out = shards(batch, world)

    local = ref["input_ids"].shape[1] // world
    for shard in out:
        assert sorted(shard) == sorted(ref)
        assert all(v.shape == (len(ids), local) for v in shard.values())
    for key, value in ref.items():
        assert torch.equal(torch.cat([s[key] for s in out], dim=1), value), key

    # Every valid label is in exactly one shard.
    per_rank = [int((s["shift_labels"] != X).sum()) for s in out]
    assert sum(per_rank) == int((ref["shift_labels"] != X).sum())

    full, seq_keys = prepare_global_batch(batch, world)
    assert sorted(seq_keys) == sorted(ref)
    for key, value in ref.items():
        assert torch.equal(full[key], value), key


def test_collated_shards_name_their_layout_and_a_mismatch_is_refused_either_way():
    from hf_longctx.data.collator import SequenceShardingCollator
    from hf_longctx.data.layout import LAYOUT_KEY, check_shard_layouts, layout_code
    from hf_longctx.distributed.layout_slot import LayoutSlot

    batch = {"input_ids": t([[1, 2, 3, 4]])}
    for kind in ("contiguous", "zigzag"):
        shard = SequenceShardingCollator(lambda rows: rows[0], 0, 2, layout=LayoutSlot(kind))([batch])
        assert shard[LAYOUT_KEY] == kind
    codes = {kind: layout_code(kind) for kind in (None, "contiguous", "zigzag")}
    check_shard_layouts([codes["zigzag"]] * 2, "zigzag", "ring")
    check_shard_layouts([codes[None], codes["contiguous"]], "contiguous", "ulysses")
    with pytest.raises(ValueError, match='ring_layout="contiguous"'):
        check_shard_layouts([codes[None], codes[None]], "zigzag", "ring")
    with pytest.raises(ValueError, match=r"\{0: 'zigzag', 1: 'contiguous'\}"):
        check_shard_layouts([codes["zigzag"], codes["contiguous"]], "zigzag", "ring")
    with pytest.raises(ValueError, match="shard_batch"):
        check_shard_layouts([codes["zigzag"]] * 2, "contiguous", "ulysses")


def test_per_token_labels_are_sliced_as_they_are_and_padded_with_ignore_index():
    """Token classification: each token keeps its own tag (no shift), SP padding carries no label."""
    labels = torch.tensor([[0, 1, 2, 3, IGNORE_INDEX]])
    batch = {"input_ids": torch.tensor([[5, 6, 7, 8, 9]]), "labels": labels}
    shards = [shard_batch_for_rank(batch, r, 2, labels="per_token") for r in range(2)]
    assert "shift_labels" not in shards[0]
    assert shards[0]["labels"].tolist() == [[0, 1, 2]]
    assert shards[1]["labels"].tolist() == [[3, IGNORE_INDEX, IGNORE_INDEX]]
    with pytest.raises(ValueError, match="labels every token itself.*shift_labels"):
        shard_batch_for_rank({**batch, "shift_labels": labels}, 0, 2, labels="per_token")


def test_shard_batch_follows_the_label_kind_the_enabled_model_claimed():
    from hf_longctx.distributed.layout_slot import LayoutSlot

    groups = SequenceParallelGroups.single()
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[1, 2, 3]])}
    assert shard_batch(batch, groups)["shift_labels"].tolist() == [[2, 3, IGNORE_INDEX]]
    groups.layout_slot.claim("contiguous", "per_token")
    assert shard_batch(batch, groups)["labels"].tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="takes per_token labels but this one takes next_token"):
        groups.layout_slot.claim("contiguous", "next_token")
    groups.layout_slot.release()
    assert groups.layout_slot == LayoutSlot()

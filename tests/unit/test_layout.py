"""Token layouts (`hf_longctx.data.layout`) and zigzag sharding, looping over SP ranks in one process."""

from __future__ import annotations

import pytest
import torch

from hf_longctx import IGNORE_INDEX
from hf_longctx.data.layout import (
    gathered_order,
    layout_indices,
    pad_multiple,
    ring_indices,
    to_global_order,
    ulysses_sort_order,
)
from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.distributed.layout_slot import LayoutSlot

X = IGNORE_INDEX


def test_zigzag_rank_holds_chunk_r_and_its_mirror():
    # S = 16, P = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert layout_indices("zigzag", 0, 2, 16).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout_indices("zigzag", 1, 2, 16).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # P = 4, S = 8: one token per chunk.
    assert [layout_indices("zigzag", r, 4, 8).tolist() for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert layout_indices("contiguous", 1, 4, 8).tolist() == [2, 3]


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_position_is_held_once_and_gathers_back_in_order(kind, world):
    seq = 6 * pad_multiple(kind, world)
    order = gathered_order(kind, world, seq)
    assert sorted(order.tolist()) == list(range(seq))
    x = torch.arange(seq).unsqueeze(0) * 10
    gathered = torch.cat([x[:, layout_indices(kind, r, world, seq)] for r in range(world)], dim=1)
    assert torch.equal(to_global_order(gathered, kind, world), x)


def test_lengths_not_a_multiple_of_2p_raise_naming_shard_batch():
    with pytest.raises(ValueError, match="shard_batch"):
        layout_indices("zigzag", 0, 2, 6)
    with pytest.raises(ValueError, match="Unknown token layout"):
        layout_indices("striped", 0, 2, 8)


@pytest.mark.parametrize("ulysses", [1, 2, 4])
def test_ring_ranks_of_a_hybrid_layout_hold_a_zigzag_pair_over_2r_chunks(ulysses):
    sp, seq = 8, 64
    ring = sp // ulysses
    for j, idx in enumerate(ring_indices("zigzag", sp, ulysses, seq)):
        assert torch.equal(idx, layout_indices("zigzag", j, ring, seq))
        members = torch.cat([layout_indices("zigzag", j * ulysses + u, sp, seq) for u in range(ulysses)])
        order = ulysses_sort_order("zigzag", sp, ulysses, j, seq)
        assert torch.equal(members if order is None else members[order], idx)
    assert ulysses_sort_order("contiguous", sp, ulysses, 0, seq) is None


def test_zigzag_shards_by_hand_with_padding_and_shift_labels():
    batch = {
        "input_ids": torch.tensor([[10, 11, 12, 13, 14, 15, 16]]),
        "labels": torch.tensor([[X, 11, 12, 13, 14, 15, 16]]),
    }
    # Padded to 8 (2P = 4 divides it): chunks [0,1] [2,3] [4,5] [6,7]; rank 0 holds 0,1,6,7.
    shards = [shard_batch_for_rank(batch, r, 2, layout="zigzag") for r in range(2)]
    assert shards[0]["input_ids"].tolist() == [[10, 11, 16, 0]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 6, 7]]
    assert shards[0]["shift_labels"].tolist() == [[11, 12, X, X]]
    assert shards[1]["input_ids"].tolist() == [[12, 13, 14, 15]]
    assert shards[1]["shift_labels"].tolist() == [[13, 14, 15, 16]]


def test_layout_slot_claims_release_and_refuses_a_second_layout():
    slot = LayoutSlot()
    slot.claim("zigzag")
    slot.claim("zigzag")
    with pytest.raises(ValueError, match="'zigzag' token layout"):
        slot.claim("contiguous")
    slot.release()
    assert slot.kind == "zigzag"
    slot.release()
    assert (slot.kind, slot.users) == ("contiguous", 0)

"""Tier 1 (no process group): the vision tower's item plan and how a tower call is cut into items."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.multimodal.vision_shard import plan_items, split_tower_call


@pytest.mark.parametrize(
    ("costs", "world", "expected"),
    [
        ([1] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        ([16, 24], 2, [(0, 1), (1, 2)]),  # by patch count, not item count
        ([100, 1, 1, 1], 2, [(0, 1), (1, 4)]),
        ([1], 2, [(0, 0), (0, 1)]),  # fewer items than ranks: an empty range
        ([1, 1, 1], 4, [(0, 1), (1, 1), (1, 2), (2, 3)]),
        ([], 2, [(0, 0), (0, 0)]),
        ([5, 7], 1, [(0, 2)]),
    ],
)
def test_plan_items(costs, world, expected):
    assert plan_items(costs, world) == expected


def test_plan_items_balanced_for_many_frames():
    costs = [64] * 30 + [256] * 10
    ranges = plan_items(costs, 4)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous, in rank order
    loads = [sum(costs[a:b]) for a, b in ranges]
    assert max(abs(load - sum(costs) / 4) for load in loads) <= max(costs)


def test_grid_call_is_cut_into_frames():
    """A (t, h, w) grid row is t frames of h * w patch rows; a run of frames keeps its patches and grids."""
    # An image (1, 2, 6) then a video (3, 2, 2), one patch row per grid cell.
    pixels = torch.cat([torch.arange(12.0), 100 + torch.arange(12.0)])[:, None]
    grid = torch.tensor([[1, 2, 6], [3, 2, 2]])
    call = split_tower_call((pixels,), {"grid_thw": grid, "flag": True, "num_items_in_batch": torch.tensor(7)})
    assert call is not None and call.costs == [12, 4, 4, 4]
    args, kwargs = call.select(1, 3)
    assert torch.equal(args[0], pixels[12:20]) and kwargs["flag"] is True and kwargs["num_items_in_batch"] == 7
    assert kwargs["grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    _, kwargs = split_tower_call((), {"hidden_states": pixels, "grid_thw": grid}).select(0, 1)
    assert torch.equal(kwargs["hidden_states"], pixels[:12]) and kwargs["grid_thw"].tolist() == [[1, 2, 6]]


def test_batch_call_cuts_inputs_with_the_images():
    pixels, mask = torch.randn(3, 3, 8, 8), torch.ones(3, 4, 4, dtype=torch.bool)
    scalar = torch.tensor(5)  # the Trainer's num_items_in_batch reaches the tower through **kwargs
    call = split_tower_call((), {"pixel_values": pixels, "patch_attention_mask": mask, "n": scalar})
    assert call.costs == [1, 1, 1]
    _, kwargs = call.select(1, 3)
    assert torch.equal(kwargs["pixel_values"], pixels[1:]) and kwargs["patch_attention_mask"].shape[0] == 2
    assert kwargs["n"] is scalar


def test_other_keyword_inputs_pass_unchanged():
    """What the model's forward hands on through **kwargs (SP's shift_labels) is not the tower's to cut."""
    pixels, labels = torch.randn(2, 3, 8, 8), torch.ones(2, 17)
    _, kwargs = split_tower_call((pixels,), {"shift_labels": labels}).select(0, 1)  # as many rows as images
    assert kwargs["shift_labels"] is labels
    _, kwargs = split_tower_call((torch.randn(8, 4),), {"grid_thw": torch.tensor([[2, 2, 2]]), "s": labels}).select(
        0, 1
    )
    assert kwargs["s"] is labels and kwargs["grid_thw"].tolist() == [[1, 2, 2]]


def test_calls_it_cannot_cut_are_left_whole():
    pixels = torch.randn(3, 3, 8, 8)
    grid = torch.tensor([[1, 2, 2]])
    assert split_tower_call((torch.randn(4, 4),), {"grid_thw": grid, "cu_seqlens": torch.tensor([0, 4])}) is None
    assert split_tower_call((pixels, torch.ones(3)), {}) is None  # a positional tensor
    assert split_tower_call((), {"grid_thw": torch.tensor([[1, 2, 2]])}) is None  # no pixels
    assert split_tower_call((torch.randn(5, 4),), {"grid_thw": torch.tensor([[1, 2, 2]])}) is None  # rows != grid


def test_only_known_batch_towers_are_cut_by_image():
    """A tower outside `BATCH_TOWERS` (Pixtral returns `[1, patches, dim]` for all its images) is not cut in batch
    layout: it runs whole; Qwen-VL grid calls are cut whatever the tower."""
    from hf_longctx.multimodal.vision_shard import BATCH_TOWERS

    assert "PixtralVisionModel" not in BATCH_TOWERS and "CLIPVisionModel" in BATCH_TOWERS
    pixels = torch.randn(3, 3, 8, 8)
    assert split_tower_call((pixels,), {}, batch_layout=False) is None
    assert split_tower_call((pixels,), {}, batch_layout=True).costs == [1, 1, 1]
    grid = torch.tensor([[1, 2, 2]])
    assert split_tower_call((torch.randn(4, 12),), {"grid_thw": grid}, batch_layout=False).costs == [4]

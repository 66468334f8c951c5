"""The planner's vision-tower share per rank: sharded over SP it falls with the SP size, unsharded it does not."""

from __future__ import annotations

import pytest

from hf_longctx.planner import RunConfig, VisionShape, vision_tower_bytes

QWEN3_VL = {"vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096,
                              "spatial_merge_size": 2, "deepstack_visual_indexes": [8, 16, 24]}}  # fmt: skip


def test_shape_from_config():
    shape = VisionShape.from_config(QWEN3_VL)
    assert (shape.depth, shape.hidden, shape.merge, shape.deepstack, shape.out_hidden) == (27, 1152, 4, 3, 4096)
    clip = VisionShape.from_config({"vision_config": {"num_hidden_layers": 2, "hidden_size": 32},
                                    "text_config": {"hidden_size": 64}})  # fmt: skip
    assert (clip.depth, clip.intermediate, clip.out_hidden, clip.merge) == (2, 128, 64, 1)
    with pytest.raises(ValueError, match="vision_config"):
        VisionShape.from_config({"hidden_size": 8})


def test_sharded_share_falls_with_sp():
    shape, patches = VisionShape.from_config(QWEN3_VL), 256 * 1024  # 256 frames of 32 x 32 patches
    one = vision_tower_bytes(shape, patches, RunConfig(seq_len=65536, world=4, sp=4), sharded=False)
    four = vision_tower_bytes(shape, patches, RunConfig(seq_len=65536, world=4, sp=4))
    assert one["patches_per_rank"] == patches and four["patches_per_rank"] == patches // 4
    assert four["saved_activations"] * 4 == one["saved_activations"]
    assert four["gathered_features"] == 2 * one["gathered_features"]  # all features and their gradient, per rank
    total = sum(four.values()) - four["patches_per_rank"], sum(one.values()) - one["patches_per_rank"]
    assert total[0] < 0.3 * total[1]
    assert vision_tower_bytes(shape, patches, RunConfig(seq_len=8, sp=1)) == {**one, "patches_per_rank": patches}

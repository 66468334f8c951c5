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


_TEXT_8B = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936}  # fmt: skip
QWEN3_VL_8B = {**QWEN3_VL, "text_config": _TEXT_8B}


def test_plan_counts_the_tower_share_of_each_rank():
    """`--vision-patches` adds the tower's share to the saved activations of every phase, and it falls with SP."""
    from hf_longctx.planner import DEVICES, ModelShape, estimate

    model, patches, device = ModelShape.from_config(QWEN3_VL_8B, name="qwen3-vl"), 64 * 1024, DEVICES["h100"]
    for sp in (2, 8):
        base = RunConfig(seq_len=131072, world=8, sp=sp, engine="zero3", gradient_checkpointing=True)
        run = RunConfig(**{**base.__dict__, "vision_patches": patches})
        share = vision_tower_bytes(model.vision, patches, run)
        added = (share["saved_activations"] + share["gathered_features"]) / 2**30
        with_tower, without = estimate(model, run, device), estimate(model, base, device)
        grown = with_tower.breakdown["saved_activations"] - without.breakdown["saved_activations"]
        assert grown == pytest.approx(added, abs=0.02), (sp, grown, added)
        assert any(f"{patches // sp:,} of {patches:,} patches" in note for note in with_tower.notes)


def test_plan_cli_refuses_vision_patches_without_a_vision_tower(tmp_path):
    import json

    from hf_longctx.cli.main import main

    text_only = tmp_path / "config.json"
    text_only.write_text(json.dumps(QWEN3_VL_8B["text_config"]))
    vlm = tmp_path / "vlm.json"
    vlm.write_text(json.dumps(QWEN3_VL_8B))
    run = ["--seq-len", "131072", "--world", "8", "--sp", "8", "--engine", "zero3", "--gradient-checkpointing"]
    assert main(["plan", "--model", str(vlm), *run, "--vision-patches", "65536"]) in (0, 3)
    assert main(["plan", "--model", str(text_only), "--seq-len", "8192", "--vision-patches", "1024"]) == 2


def test_checkpointed_tower_keeps_block_inputs_and_one_block():
    shape, patches = VisionShape.from_config(QWEN3_VL), 4096
    full = vision_tower_bytes(shape, patches, RunConfig(seq_len=8192))
    kept = vision_tower_bytes(shape, patches, RunConfig(seq_len=8192, gradient_checkpointing=True))
    per_block = full["saved_activations"] // shape.depth
    assert kept["saved_activations"] == patches * shape.depth * shape.hidden * 2 + per_block
    assert kept["gathered_features"] == full["gathered_features"]

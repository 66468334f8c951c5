"""The vision tower's share of a rank's memory under SP (the planner's only vision-language input).

`vision_tower_bytes(shape, patches, run)` is the main function. The rest of the planner models the decoder
(a VLM's `text_config`); this adds the tower: with the tower sharded over the SP group (the default,
`hf_longctx/multimodal/vision_shard.py`) a rank keeps the activations of about `patches / sp` patches, plus
the merged features of every image, gathered, and their gradient; unsharded it keeps all `patches`.
"""

from __future__ import annotations

from hf_longctx.planner.model_shape import VisionShape, ceil_div
from hf_longctx.planner.run import RunConfig

__all__ = ["VisionShape", "vision_tower_bytes"]

# Activation elements a ViT block keeps per patch for its backward, in units of (hidden, intermediate): the
# two norms' inputs, q/k/v, the attention output, the projection's input and output (hidden each), and the
# MLP's input, pre- and post-activation (intermediate each).
_BLOCK_HIDDEN, _BLOCK_INTERMEDIATE = 8, 3


def vision_tower_bytes(shape: VisionShape, patches: int, run: RunConfig, sharded: bool = True) -> dict[str, int]:
    """Bytes one rank holds for the vision tower in a training step on `patches` patches (all images of the batch).

    Args:
        shape: the tower's sizes.
        patches: patches of every image and frame of the rank's batch (before the merge).
        run: the run (its `sp` and activation dtype).
        sharded: the tower sharded over the SP group (hf_longctx's default under SP).

    Returns:
        `patches_per_rank`, `saved_activations` (the blocks' saved activations for those patches) and
        `gathered_features` (the merged output and DeepStack maps of all patches, and their gradient).
    """
    per_rank = ceil_div(patches, run.sp) if sharded and run.sp > 1 else patches
    per_patch = _BLOCK_HIDDEN * shape.hidden + _BLOCK_INTERMEDIATE * shape.intermediate
    if run.gradient_checkpointing:  # transformers checkpoints the tower's blocks too: their inputs, one recomputed
        saved = per_rank * (shape.depth * shape.hidden + per_patch) * run.act_bytes
    else:
        saved = per_rank * shape.depth * per_patch * run.act_bytes
    features = ceil_div(patches, shape.merge) * shape.out_hidden * (1 + shape.deepstack)
    gathered = 2 * features * run.act_bytes if sharded and run.sp > 1 else features * run.act_bytes
    return {"patches_per_rank": per_rank, "saved_activations": saved, "gathered_features": gathered}

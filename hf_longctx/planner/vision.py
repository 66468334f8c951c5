"""The vision tower's share of a rank's memory under SP (the planner's only vision-language input).

`vision_tower_bytes(shape, patches, run)` is the main function. The rest of the planner models the decoder
(a VLM's `text_config`); this adds the tower: with the tower sharded over the SP group (the default,
`hf_longctx/multimodal/vision_shard.py`) a rank keeps the activations of about `patches / sp` patches, plus
the merged features of every image, gathered, and their gradient; unsharded it keeps all `patches`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hf_longctx.planner.model_shape import ceil_div
from hf_longctx.planner.run import RunConfig

# Activation elements a ViT block keeps per patch for its backward, in units of (hidden, intermediate): the
# two norms' inputs, q/k/v, the attention output, the projection's input and output (hidden each), and the
# MLP's input, pre- and post-activation (intermediate each).
_BLOCK_HIDDEN, _BLOCK_INTERMEDIATE = 8, 3


@dataclass(frozen=True)
class VisionShape:
    """The sizes of a vision tower that set its activation memory."""

    depth: int
    hidden: int
    intermediate: int
    out_hidden: int
    merge: int = 1  # patches merged into one feature (spatial_merge_size ** 2)
    deepstack: int = 0  # extra feature maps gathered with the output (Qwen3-VL)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionShape:
        """Read a VLM `config.json` dict's `vision_config` (Qwen-VL `depth` or CLIP-style `num_hidden_layers`).

        Raises:
            ValueError: no vision config, or one without its depth and width.
        """
        vision = config.get("vision_config")
        depth = vision and (vision.get("depth") or vision.get("num_hidden_layers"))
        if not vision or not depth or "hidden_size" not in vision:
            raise ValueError("vision_tower_bytes needs a config.json with a vision_config (depth and hidden_size).")
        hidden = int(vision["hidden_size"])
        return cls(
            depth=int(depth),
            hidden=hidden,
            intermediate=int(vision.get("intermediate_size") or 4 * hidden),
            out_hidden=int(vision.get("out_hidden_size") or config.get("text_config", {}).get("hidden_size") or hidden),
            merge=int(vision.get("spatial_merge_size") or 1) ** 2,
            deepstack=len(vision.get("deepstack_visual_indexes") or ()),
        )


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
    saved = per_rank * shape.depth * per_patch * run.act_bytes
    features = ceil_div(patches, shape.merge) * shape.out_hidden * (1 + shape.deepstack)
    gathered = 2 * features * run.act_bytes if sharded and run.sp > 1 else features * run.act_bytes
    return {"patches_per_rank": per_rank, "saved_activations": saved, "gathered_features": gathered}

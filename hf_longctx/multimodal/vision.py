"""Vision-language models under SP: images and their merge on the full row, the decoder on shards.

A VLM's top-level forward receives this rank's shard like any causal LM (hf_longctx shards every
`[batch, seq]` tensor; `pixel_values` and the image grids are not). Two steps inside it need the whole
row: placing the image features at the image tokens (`masked_scatter` over the row) and, for
Qwen2.5-VL / Qwen3-VL, the 3-D mRoPE positions (computed from the token ids and image grids of the
row). So, per forward:

1. a pre-hook on the multimodal model (the module that owns `language_model`) all-gathers the shard's
   `input_ids`, `attention_mask` and `mm_token_type_ids` over the SP group (small integer tensors) and
   hands the model the full row; `position_ids` are dropped where the model computes its own
   (mRoPE), and are the full row's otherwise;
2. the vision tower runs sharded over the SP group (`vision_shard.py`): each image or video frame is
   encoded on one rank, balanced by patches, and the features are all-gathered; they are merged on the
   full sequence as without SP;
3. a pre-hook on the decoder (`language_model`) slices `inputs_embeds`, `position_ids`,
   `attention_mask` and Qwen3-VL's DeepStack `visual_pos_masks` / `deepstack_visual_embeds` back to
   this rank's shard, in the data's token layout; the decoder, the head and the loss run sharded.

Gradients reach the features through the slicing (each rank: the part from its own tokens); the gather's
backward sums them over the SP group and hands each rank its own images' rows, so the tower's parameter
gradients, summed over the SP group like every replicated parameter's (the embeddings), count each image
once. Gemma 3 is refused under SP (bidirectional attention within images in its decoder).
For packed rows (positions that restart) of mRoPE models the hook computes each document's positions as if it
were alone, with the model's own `get_rope_index` (`mrope.py`): transformers computes them per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.data.layout import layout_indices, to_global_order
from hf_longctx.distributed.comm import all_gather_sequence
from hf_longctx.multimodal.mrope import document_rope_positions
from hf_longctx.multimodal.vision_shard import shard_vision_tower

_VISION_TOWERS = ("visual", "vision_tower", "vision_model")
_FULL_ROW_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")
_ROPE_FROM_IDS = ("compute_3d_position_ids", "get_rope_index")
# Families whose decoder needs more than the full-row merge and causal shards.
_REFUSED = {
    "gemma3": "its decoder attends bidirectionally within each image (token_type_ids), which the SP attention "
    "(causal, from global positions) does not reproduce.",
    "molmo2": "its decoder attends bidirectionally within the image tokens (block_sequence_ids from "
    "mm_token_type_ids), which the SP attention (causal, from global positions) does not reproduce.",
}


def vision_refusal(inner: torch.nn.Module) -> str | None:
    """Why hf_longctx cannot serve this multimodal model's decoder at any SP size (None: it can)."""
    return _REFUSED.get(getattr(getattr(inner, "config", None), "model_type", ""))


def vision_tower(inner: torch.nn.Module) -> torch.nn.Module:
    """The vision tower module of a multimodal model (`multimodal_model`'s result): `visual`, `vision_tower` or
    `vision_model`."""
    return next(inner._modules[t] for t in _VISION_TOWERS if t in inner._modules)


def multimodal_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module that merges image features into the embeddings and calls `language_model`, or None
    for a text-only model."""
    for module in model.modules():
        if "language_model" in module._modules and any(t in module._modules for t in _VISION_TOWERS):
            return module
    return None


def install_vision_hooks(model: torch.nn.Module, handle: Any) -> list[Callable[[], None]]:
    """Hooks that run a VLM's vision side on the full row and its decoder on shards (module docstring).

    `handle` is the model's `SequenceParallelHandle` (groups, token layout, the forward's context).
    Returns the undo callables; none for a text-only model.
    """
    inner = multimodal_model(model)
    if inner is None:
        other = next((m for m in model.modules() if any(t in m._modules for t in _VISION_TOWERS)), None)
        if other is not None and handle.groups.sp_enabled:
            raise ValueError(
                f"{type(other).__name__} has a vision tower but no `language_model` decoder: hf_longctx places image "
                "features on the full row only for models built as <tower> + language_model (Qwen-VL, LLaVA, "
                "InternVL); its image tokens would be split from their features under SP."
            )
        return []
    refused = vision_refusal(inner)
    if refused and handle.groups.sp_enabled:
        raise ValueError(f"{type(inner).__name__} under sequence parallelism is not supported: {refused}")
    groups, layout = handle.groups, handle.backend.layout
    rope_from_ids = any(hasattr(inner, name) for name in _ROPE_FROM_IDS)

    def gather(x: torch.Tensor) -> torch.Tensor:
        full = all_gather_sequence(x.contiguous(), groups.sp_group)
        return to_global_order(full, layout, groups.sp_world_size)

    def full_row(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
        if args:
            raise ValueError(f"{type(module).__name__} must be called with keyword arguments under SP.")
        context = handle.context
        if not groups.sp_enabled and (context is None or kwargs.get("input_ids") is None):
            # sp_size=1: generation or given mRoPE positions (attention/single.py), or inputs_embeds: as is
            return args, kwargs
        if kwargs.get("input_ids") is None or context is None:
            raise ValueError(
                "A vision-language model under sequence parallelism must be called with input_ids through its "
                "top-level forward (the image tokens are placed on the full row)."
            )
        packed = rope_from_ids and not context.single_document
        if packed and not hasattr(module, "get_rope_index"):
            raise ValueError(
                f"{type(module).__name__} computes its 3-D (mRoPE) positions per row and has no get_rope_index to "
                "compute them per document, so packed rows (positions that restart) would train with positions "
                "unlike a run without SP. Pad rows instead of packing them (SFTConfig(padding_free=False, "
                "packing=False))."
            )
        for key in _FULL_ROW_KEYS:
            if isinstance(kwargs.get(key), torch.Tensor):
                kwargs[key] = gather(kwargs[key])
        positions = context.position_ids.to(kwargs["input_ids"].device)
        if packed:  # each document's mRoPE positions as if alone (`mrope.py`)
            kwargs["position_ids"] = document_rope_positions(module, kwargs, positions)
        else:  # one document per row: the model's own mRoPE positions of the row, or the row's 1-D positions
            kwargs["position_ids"] = None if rope_from_ids else positions
        return args, kwargs

    def shard(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None or handle.context is None or embeds.shape[1] != handle.context.position_ids.shape[1]:
            return args, kwargs  # the decoder called on its own (no image merge): already sharded
        n = embeds.shape[1]
        index = layout_indices(layout, groups.sp_rank, groups.sp_world_size, n)
        mask, deepstack = kwargs.get("visual_pos_masks"), kwargs.get("deepstack_visual_embeds")
        if deepstack is not None and isinstance(mask, torch.Tensor):  # one feature row per visual token of the row
            rows = _visual_rows(mask, index)
            kwargs["deepstack_visual_embeds"] = [e.index_select(0, rows.to(e.device)) for e in deepstack]
        for key in ("attention_mask", "visual_pos_masks"):
            if isinstance(kwargs.get(key), torch.Tensor):
                kwargs[key] = kwargs[key].index_select(1, index.to(kwargs[key].device))
        kwargs["inputs_embeds"] = embeds.index_select(1, index.to(embeds.device))
        pos = kwargs.get("position_ids")
        if pos is None:  # the model found no image to place (mRoPE): the decoder would count from 0 per shard
            pos = torch.arange(n, device=embeds.device).expand(embeds.shape[0], n)
        kwargs["position_ids"] = pos.index_select(pos.dim() - 1, index.to(pos.device))  # [bs, sl] or [3|4, bs, sl]
        return args, kwargs

    inside: list[bool] = [False]  # the multimodal forward is running (the tower's calls in it are collective)

    def enter(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple:
        args, kwargs = full_row(module, args, kwargs)
        inside[0] = True
        return args, kwargs

    def leave(*_: Any) -> None:
        inside[0] = False

    hooks = [
        inner.register_forward_pre_hook(enter, with_kwargs=True),
        inner.register_forward_hook(leave, always_call=True),
        inner.language_model.register_forward_pre_hook(shard, with_kwargs=True),
    ]
    return [h.remove for h in hooks] + shard_vision_tower(vision_tower(inner), groups, lambda: inside[0])


def _visual_rows(full_mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of the DeepStack features (one per visual token of the full row, row-major) that fall on `index`."""
    index = index.to(full_mask.device)
    order = (full_mask.flatten().long().cumsum(0) - 1).view_as(full_mask)
    return order.index_select(1, index)[full_mask.index_select(1, index)]

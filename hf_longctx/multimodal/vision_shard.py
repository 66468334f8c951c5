"""The vision tower sharded over the SP group: each image or video frame encoded once in the job.

`shard_vision_tower(tower, groups, active)` is the main entry. A pre-hook on the tower splits its input into items
(a Qwen-VL grid's frames, or the images of a `[images, ...]` batch), keeps this rank's contiguous run of
items, balanced by patch count (`plan_items`), and a forward hook all-gathers every tensor of the output
along dim 0 (`all_gather_rows`), so the model sees the output of the whole input, as without SP. The
gather's backward sums the features' gradient over the SP group and hands each rank the rows it encoded:
each item's contribution to the tower's gradient is computed on one rank, and the SP-group sum of the
replicated parameters' gradients (as for the embeddings) counts it once.

A rank with no item of its own encodes the first item and discards it (zero rows gathered, zero gradient):
every rank runs the tower forward and backward, so FSDP2 / ZeRO-3 parameter gathers and the feature gather
stay matched. A call the hooks cannot split (no pixel tensor, another positional tensor, a Qwen-VL call with
precomputed whole-call inputs) runs whole on every rank, as before. Only calls inside the model's forward
(`active()`), which every SP rank makes together, are split: a rank calling the tower on its own (e.g.
`get_image_features` outside the forward) gets the whole input encoded there, and no collective to wait on.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_longctx.distributed.comm import all_gather_rows

logger = logging.getLogger(__name__)

_PIXEL_KEYS = ("pixel_values", "hidden_states")  # Qwen2.5-VL names the tower's pixel input hidden_states
_GRID_KEY = "grid_thw"
# Towers whose batch-layout call encodes each image apart and returns one output row per image in dim 0: only
# theirs are cut by image. Others (Pixtral joins every patch into one sequence, `[1, patches, dim]`; towers with a
# grid under another name or per-image shapes not in `_PER_IMAGE`) run whole, exact but unsharded.
BATCH_TOWERS = frozenset({"CLIPVisionModel", "SiglipVisionModel", "InternVLVisionModel"})
# Inputs of batch-layout towers with one entry per image, cut with the images; any other passes unchanged.
_PER_IMAGE = ("patch_attention_mask", "pixel_attention_mask", "image_sizes")
# Inputs a Qwen-VL tower takes precomputed for the whole call (transformers' `vision_utils`): such a call runs whole.
_PRECOMPUTED = ("cu_seqlens", "max_seqlen", "position_ids", "window_index", "cu_window_seqlens", "max_window_seqlen",
                "interp_indices", "interp_weights", "bilinear_indices", "bilinear_weights", "merged_shape")  # fmt: skip


def plan_items(costs: list[int], sp_world_size: int) -> list[tuple[int, int]]:
    """Contiguous `[start, stop)` item ranges, one per rank, balanced by cost.

    Each item goes to the rank whose equal share of the total cost holds the item's midpoint, so ranges are
    contiguous, in rank order, and each within one item of `total / sp_world_size`; with fewer items than
    ranks some ranges are empty.

    Args:
        costs: each item's cost (patches), in input order.
        sp_world_size: ranks in the SP group.

    Returns:
        `sp_world_size` ranges covering `range(len(costs))` in order.
    """
    total, prefix = max(sum(costs), 1), 0
    stops = [0] * sp_world_size
    for i, cost in enumerate(costs):
        rank = min(sp_world_size - 1, (2 * prefix + cost) * sp_world_size // (2 * total))
        stops[rank] = i + 1
        prefix += cost
    for r in range(1, sp_world_size):
        stops[r] = max(stops[r], stops[r - 1])
    return list(zip([0, *stops[:-1]], stops, strict=True))


@dataclass
class TowerCall:
    """A tower call cut into items: `costs` per item and `select(start, stop)` -> the call's (args, kwargs)."""

    costs: list[int]
    select: Callable[[int, int], tuple[tuple, dict[str, Any]]]


def split_tower_call(args: tuple, kwargs: dict[str, Any], batch_layout: bool = True) -> TowerCall | None:
    """The items of one tower call, or None where the call has inputs these hooks do not know how to cut.

    Qwen-VL layout (a `grid_thw` input): the items are frames, `(t, h, w)` giving t frames of h * w patch
    rows each (the tower attends within a frame and merges patches within it, so a run of frames encodes
    as in the whole call); a call with precomputed whole-call inputs (`cu_seqlens`, ...) is not cut. Batch
    layout: the items are dim 0 of the pixel tensor, cost 1 each; per-image inputs (`_PER_IMAGE`: patch masks,
    image sizes) are cut with it. Other keyword inputs (what the model's forward passes on through
    `**kwargs`: the Trainer's `num_items_in_batch`, SP's `shift_labels`) pass unchanged. `batch_layout=False`
    (a tower not in `BATCH_TOWERS`): a call without a grid is not cut.
    """
    pixel_key = next((k for k in _PIXEL_KEYS if isinstance(kwargs.get(k), torch.Tensor)), None)
    if args and isinstance(args[0], torch.Tensor):
        pixels, rest_args = args[0], args[1:]
    elif pixel_key is not None:
        pixels, rest_args = kwargs[pixel_key], args
    else:
        return None
    if any(_per_item(a) for a in rest_args):
        return None
    others = {k: v for k, v in kwargs.items() if k != pixel_key}
    grid = others.pop(_GRID_KEY, None)
    if isinstance(grid, torch.Tensor):
        return _grid_call(pixels, grid, rest_args, others, pixel_key)
    return _batch_call(pixels, rest_args, others, pixel_key) if batch_layout else None


def _grid_call(
    pixels: torch.Tensor, grid: torch.Tensor, args: tuple, others: dict[str, Any], pixel_key: str | None
) -> TowerCall | None:
    if any(key in others for key in _PRECOMPUTED):
        return None
    frames = grid.repeat_interleave(grid[:, 0], dim=0).clone()  # one (1, h, w) row per frame
    frames[:, 0] = 1
    costs = (frames[:, 1] * frames[:, 2]).tolist()
    offsets = [0, *itertools.accumulate(costs)]
    if offsets[-1] != pixels.shape[0]:
        return None  # not one patch row per grid cell: leave the call whole

    def select(start: int, stop: int) -> tuple[tuple, dict[str, Any]]:
        part = pixels[offsets[start] : offsets[stop]]
        kwargs = {**others, _GRID_KEY: frames[start:stop]}
        if pixel_key is None:
            return (part, *args), kwargs
        return args, {**kwargs, pixel_key: part}

    return TowerCall(costs, select)


def _batch_call(pixels: torch.Tensor, args: tuple, others: dict[str, Any], pixel_key: str | None) -> TowerCall:
    n = pixels.shape[0]
    cut = {k for k in _PER_IMAGE if _per_item(others.get(k)) and others[k].shape[0] == n}

    def select(start: int, stop: int) -> tuple[tuple, dict[str, Any]]:
        kwargs = {k: v[start:stop] if k in cut else v for k, v in others.items()}
        if pixel_key is None:
            return (pixels[start:stop], *args), kwargs
        return args, {**kwargs, pixel_key: pixels[start:stop]}

    return TowerCall([1] * n, select)


def _per_item(value: Any) -> bool:
    """A tensor that may hold one entry per item (not a scalar such as the Trainer's `num_items_in_batch`)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _leaves(output: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The tensors of a tower output (a tensor, a ModelOutput, nested tuples/lists) and how to rebuild it;
    scalars are left as they are (they have no rows to gather)."""
    if _per_item(output):
        return [output], lambda xs: xs[0]
    if isinstance(output, dict):  # ModelOutput: set fields in place, keep its class
        keys = [k for k in output if output[k] is not None]
        parts = [_leaves(output[k]) for k in keys]

        def rebuild_dict(xs: list[torch.Tensor]) -> Any:
            for key, (leaves, rebuild) in zip(keys, parts, strict=True):
                output[key] = rebuild(xs[: len(leaves)])
                xs = xs[len(leaves) :]
            return output

        return [x for leaves, _ in parts for x in leaves], rebuild_dict
    if isinstance(output, (tuple, list)):
        parts = [_leaves(o) for o in output]

        def rebuild_seq(xs: list[torch.Tensor]) -> Any:
            items = []
            for leaves, rebuild in parts:
                items.append(rebuild(xs[: len(leaves)]))
                xs = xs[len(leaves) :]
            return type(output)(items)

        return [x for leaves, _ in parts for x in leaves], rebuild_seq
    return [], lambda xs: output


def shard_vision_tower(tower: torch.nn.Module, groups: Any, active: Callable[[], bool]) -> list[Callable[[], None]]:
    """Run `tower` on this rank's share of each call's items and all-gather its output (module docstring).

    Args:
        tower: the vision tower module (Qwen's `visual`, LLaVA's / InternVL's `vision_tower`).
        groups: the `SequenceParallelGroups`; nothing is installed without SP.
        active: whether the model's forward (a call every SP rank makes) is running; other calls run whole.

    Returns:
        The undo callables of the two hooks.
    """
    if not groups.sp_enabled:
        return []
    pending: dict[str, Any] = {}
    logged: list[bool] = []

    def before(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        pending.clear()
        if not active():
            return None
        call = split_tower_call(args, kwargs, batch_layout=type(module).__name__ in BATCH_TOWERS)
        if call is None:
            if not logged:  # once per tower
                logger.info("hf_longctx: %s called with inputs it cannot split; it runs whole.", type(module).__name__)
                logged.append(True)
            return None
        if not call.costs:
            return None
        start, stop = plan_items(call.costs, groups.sp_world_size)[groups.sp_rank]
        pending.update(items=len(call.costs), empty=start == stop)
        if start == stop:  # nothing of its own: encode the first item so every rank runs the tower
            start, stop = 0, 1
        return call.select(start, stop)

    def after(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if not pending:
            return None
        state = dict(pending)
        pending.clear()
        leaves, rebuild = _leaves(output)
        if state["empty"]:
            leaves = [x[:0] for x in leaves]  # the stand-in item's rows: none gathered, zero gradient
        return rebuild(all_gather_rows(leaves, groups.sp_group, check=state["items"]))

    hooks = [
        tower.register_forward_pre_hook(before, with_kwargs=True),
        tower.register_forward_hook(after, with_kwargs=True),
    ]
    return [h.remove for h in hooks]

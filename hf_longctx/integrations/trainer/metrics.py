"""Metric gathering under SP: every value is merged over its SP group first, then gathered over DP.

accelerate gathers metric tensors from every rank and, at the end of a dataloader, keeps the first
`remainder` samples, computed for the DP-sized loader. Under SP a DP rank's batch is spread over its
SP group, so the group's values are merged into the one value a DP-only run would have, and then
gathered over the DP group only. How to merge depends on what a value is, so there are two entry
points with explicit semantics, never a guess from the shape:

- `gather_for_metrics` (what `accelerator.gather_for_metrics` becomes; TRL's metrics and user code
  call it): 0-d and 1-d tensors are per-rank partial sums (TRL's token counts, correct-token counts,
  entropy sums) and are summed over the SP group, except values hf_longctx marked as whole on every rank
  (`sequence.mark_replicated`: the MoE router loss it returns), taken once; tensors with more dims must be
  identical on every SP rank (checked; a ValueError names the problem otherwise) and are taken once.
- `gather_replicated` (the Trainer's evaluation loop, after `prediction_step` has merged its loss,
  logits and labels over the SP group): every value is already the DP rank's value.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from hf_longctx.distributed.comm import all_gather_object, all_gather_stacked, all_reduce_sum
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.sequence.replicated import is_replicated


def _apply(fn: Any, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        return type(data)(_apply(fn, d) for d in data)
    if isinstance(data, dict):
        return {k: _apply(fn, v) for k, v in data.items()}
    raise TypeError(type(data).__name__)


def _fingerprint(data: torch.Tensor) -> torch.Tensor:
    # Shape, dtype and bytes of a value, in one int64 pair: enough to tell replicated from per-rank values.
    raw = data.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    layout = f"{tuple(data.shape)}:{data.dtype}".encode()
    return torch.tensor([zlib.crc32(layout), zlib.crc32(raw)], dtype=torch.int64, device=data.device)


def merge_sp_group(data: torch.Tensor, groups: SequenceParallelGroups) -> torch.Tensor:
    """One DP rank's value from its SP ranks' values: 0-d/1-d summed, others checked identical.

    Raises:
        ValueError: a tensor with 2+ dims differs across the SP group (e.g. computed from one rank's
            slice of the sequence), which has no rank-independent merge.
    """
    if is_replicated(data):  # made whole on every SP rank by hf_longctx (the router loss it returns)
        return data.detach()
    data = data.detach()
    if data.dim() <= 1:
        return all_reduce_sum(data.reshape(-1) if data.dim() == 0 else data, groups.sp_group)
    prints = all_gather_stacked(_fingerprint(data), groups.sp_group)
    if bool((prints != prints[0]).any()):
        raise ValueError(
            f"gather_for_metrics got a tensor of shape {tuple(data.shape)} that differs across the "
            "sequence-parallel ranks. Under SP, 0-d/1-d values are summed over the SP group (per-rank partial "
            "counts) and values with more dims must be the same on every SP rank: gather a sequence-sharded "
            "tensor over `groups.sp_group` yourself first (hf_longctx.distributed.comm.all_gather_sequence), "
            "or reduce it to per-rank sums."
        )
    return data


def _gather_dp(data: torch.Tensor, groups: SequenceParallelGroups) -> torch.Tensor:
    data = data.reshape(1) if data.dim() == 0 else data  # accelerate gathers a scalar into one value per rank
    return torch.cat(all_gather_stacked(data, groups.dp_group).unbind(0), dim=0)


def _truncate(accelerator: Any, data: Any, objects: bool) -> Any:
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        cut = lambda t: t[: state.remainder]  # noqa: E731
        return cut(data) if objects else _apply(cut, data)
    return data


def _gather_objects(accelerator: Any, groups: SequenceParallelGroups, data: Any) -> Any:
    # Objects are replicated over the SP group: gather one copy per DP rank, flattened like accelerate's.
    gathered = all_gather_object(data, groups.dp_group)
    flat = [x for part in gathered for x in (part if isinstance(part, (list, tuple)) else [part])]
    return _truncate(accelerator, flat, objects=True)


def gather_for_metrics(
    accelerator: Any, groups: SequenceParallelGroups, input_data: Any, use_gather_object: bool = False
) -> Any:
    """Drop-in for `Accelerator.gather_for_metrics` on an accelerator with hf_longctx SP.

    Args:
        accelerator: the accelerator (its `gradient_state` gives the end-of-dataloader remainder).
        groups: the SP/DP groups.
        input_data: a tensor or a nested list/tuple/dict of tensors.
        use_gather_object: gather Python objects (taken as identical on the SP ranks).

    Returns:
        What a DP-only run would gather: one entry per DP rank's samples, truncated at the end.

    Raises:
        ValueError: see `merge_sp_group`.
    """
    if not use_gather_object:
        try:
            merged = _apply(lambda t: _gather_dp(merge_sp_group(t, groups), groups), input_data)
        except TypeError:
            use_gather_object = True
        else:
            return _truncate(accelerator, merged, objects=False)
    return _gather_objects(accelerator, groups, input_data)


def gather_replicated(
    accelerator: Any, groups: SequenceParallelGroups, input_data: Any, use_gather_object: bool = False
) -> Any:
    """`gather_for_metrics` for values every SP rank holds identically: gathered over the DP group only."""
    if not use_gather_object:
        try:
            gathered = _apply(lambda t: _gather_dp(t.detach(), groups), input_data)
        except TypeError:
            use_gather_object = True
        else:
            return _truncate(accelerator, gathered, objects=False)
    return _gather_objects(accelerator, groups, input_data)

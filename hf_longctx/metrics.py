"""`gather_for_metrics` for sequence-parallel ranks: merge the SP group first, then gather over DP.

accelerate gathers metric tensors from every rank and, at the end of a dataloader, keeps the first
`remainder` samples, which it computes for the DP-sized loader. Under SP each DP rank's sample is
spread over the SP group, so the group is merged first: tensors with a sequence axis (`dim >= 2`,
sharded on dim 1) are concatenated along it, and reduced values (scalars, per-sample vectors:
token counts, summed losses, a rank's share of the loss) are summed. The result has the shape a
DP-only run gathers, and accelerate's remainder rule applies unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .comm import all_gather_sequence, all_reduce_sum
from .data.layout import to_global_order
from .groups import SequenceParallelGroups


def merge_sp_group(data: torch.Tensor, groups: SequenceParallelGroups) -> torch.Tensor:
    """One DP rank's value from its SP shards: sequence tensors concatenated on dim 1, others summed."""
    data = data.detach()
    if data.dim() >= 2:  # shards in rank order, put back in sequence order (zigzag layout: issue 10)
        return to_global_order(
            all_gather_sequence(data.contiguous(), groups.sp_group, dim=1), groups.layout, groups.sp_world_size
        )
    return all_reduce_sum(data.reshape(-1) if data.dim() == 0 else data, groups.sp_group)


def _apply(fn: Any, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        return type(data)(_apply(fn, d) for d in data)
    if isinstance(data, dict):
        return {k: _apply(fn, v) for k, v in data.items()}
    raise TypeError(type(data).__name__)


def _gather_dp(data: torch.Tensor, groups: SequenceParallelGroups) -> torch.Tensor:
    if groups.dp_world_size == 1:
        return data
    parts = [torch.empty_like(data) for _ in range(groups.dp_world_size)]
    dist.all_gather(parts, data.contiguous(), group=groups.dp_group)
    return torch.cat(parts, dim=0)


def gather_for_metrics(
    accelerator: Any, groups: SequenceParallelGroups, original: Any, input_data: Any, use_gather_object: bool = False
) -> Any:
    """Drop-in for `Accelerator.gather_for_metrics` on an accelerator with hf_longctx SP.

    Args:
        accelerator: the accelerator (its `gradient_state` gives the end-of-dataloader remainder).
        groups: the SP/DP groups.
        original: accelerate's bound `gather_for_metrics`, used for Python objects.
        input_data: a tensor or a nested list/tuple/dict of tensors.
        use_gather_object: gather Python objects instead (delegated to accelerate).

    Returns:
        What a DP-only run would gather: one entry per DP rank's samples, truncated at the end.
    """
    try:
        merged = _apply(lambda t: _gather_dp(merge_sp_group(t, groups), groups), input_data)
    except TypeError:
        use_gather_object = True
    if use_gather_object:
        return original(input_data, use_gather_object=True)
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        return _apply(lambda t: t[: state.remainder], merged)
    return merged

"""RoPE whose frequencies depend on the sequence at run time, computed from the whole sequence under SP.

transformers' `dynamic_rope_update` decorator (dynamic NTK: `rope_type` containing "dynamic"; `"longrope"`, Phi-3
and PhiMoE) reads `torch.max(position_ids) + 1` of the positions the rotary module is given, rescales its inverse
frequencies and keeps state across forwards (`max_seq_len_cached`); PhiMoE's forward also picks its `mscale` from
it. Under SP a rank gives it its shard's positions: another length, other frequencies (gradients 63% off at SP=2 on
one document, measured). transformers has no hook for the length, so each such rotary module gets an instance patch
(`_patching.Patch`, removed with the SP handle) that appends ONE position, the largest real position of the whole
batch (an all-reduced max over the SP group, SP padding excluded), to the positions it is given and drops that
column from the result; SP padding tokens get that position too. The module then updates its state exactly as
without SP and computes the shard's cos/sin with the frequencies of the whole sequence.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.distributed.comm import all_reduce_max
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.sequence.view import ShardView

RUNTIME_ROPE_TYPES = ("dynamic", "longrope")  # "dynamic" as a substring, as transformers tests it


@functools.cache
def _decorated_code() -> Any:
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


@functools.cache
def _reads_largest_position(forward: Any) -> bool:
    # PhiMoE's rotary forward also picks its mscale from `torch.max(position_ids) + 1` itself.
    try:
        return "max(position_ids)" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def runtime_rope_types(module: torch.nn.Module) -> list[str]:
    """What of `module`'s RoPE reads the sequence at run time: its dynamic / longrope types, and "max(position_ids)"
    when its own forward reads it (empty: nothing, or not one of transformers' decorated rotary modules)."""
    forward = type(module).forward
    if getattr(forward, "__code__", None) is not _decorated_code():
        return []
    kinds = getattr(module, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    found = [k for k in kinds if isinstance(k, str) and ("dynamic" in k or k == "longrope")]
    return found + (["max(position_ids)"] if _reads_largest_position(inspect.unwrap(forward)) else [])


def _with_global_length(
    original: Callable[..., Any], view: Callable[[], ShardView | None], groups: SequenceParallelGroups
) -> Callable[..., Any]:
    def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        current = view()
        if current is None:  # not a forward hf_longctx sharded (e.g. a call outside the model's forward)
            return original(x, position_ids, *args, **kwargs)
        real = current.real_tokens().to(position_ids.device)
        if real.numel() != position_ids.shape[-1]:
            raise ValueError(
                f"The rotary embedding got {position_ids.shape[-1]} positions for a shard of {real.numel()} tokens: "
                "hf_longctx cannot tell the whole sequence's length for its run-time RoPE."
            )
        local = torch.where(real, position_ids, torch.full_like(position_ids, -1)).max()
        longest = all_reduce_max(local.reshape(1), groups.sp_group).to(position_ids.dtype)
        # SP padding continues the last document's positions past the real ones: it takes the largest real
        # position instead (its cos / sin reach no real token: causality hides it and no loss counts it).
        positions = torch.where(real, position_ids, longest)
        out = original(x, torch.cat([positions, longest.expand(*position_ids.shape[:-1], 1)], dim=-1), *args, **kwargs)
        drop = lambda t: t[..., :-1, :]  # noqa: E731 - cos / sin are [..., positions, dim]
        return tuple(drop(t) for t in out) if isinstance(out, tuple) else drop(out)

    return forward


def patch_runtime_rope(
    model: torch.nn.Module, view: Callable[[], ShardView | None], groups: SequenceParallelGroups
) -> list[Patch]:
    """Patch every run-time rotary module of `model` (see the module docstring); returns the applied patches."""
    patches = []
    for module in model.modules():
        if runtime_rope_types(module):
            patch = Patch(module, "forward", lambda original: _with_global_length(original, view, groups))
            patch.apply()
            patches.append(patch)
    return patches

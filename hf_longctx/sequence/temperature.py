"""Query scales that depend on the token's index in the row: Llama 4's attention temperature, made global.

Llama 4's no-RoPE layers (`attn_temperature_tuning`, arXiv 2501.19399) scale each query by
`log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`, with `i = arange(tokens given) + cached length` computed
inside the attention module. Under SP the module is given a shard, so `i` restarts at 0 on every rank (gradients
28% off at SP=2, measured). The query reaches hf_longctx's attention function already scaled; this rescales it
by `scale(global index) / scale(local index)` before any exchange. The scale is at least 1, so the ratio is
well defined; in float32 the result equals the run without SP to round-off (two roundings instead of one in
bf16/fp16).
"""

from __future__ import annotations

import torch

from hf_longctx.data.layout import layout_indices


def _scale(index: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    return torch.log1p(torch.floor((index.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def scales_query_by_index(module: torch.nn.Module) -> bool:
    """Whether `module` scales its queries by their index in the row (Llama 4's temperature tuning)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def globally_scaled_query(
    module: torch.nn.Module, query: torch.Tensor, layout: str, sp_rank: int, sp_world_size: int, seq_len: int
) -> torch.Tensor:
    """`query` `[bs, heads, sl_l, d]` of this rank's tokens, scaled by their index in the row of `seq_len`."""
    local = torch.arange(query.shape[-2], device=query.device)
    index = layout_indices(layout, sp_rank, sp_world_size, seq_len).to(query.device)
    ratio = (_scale(index, module) / _scale(local, module)).view(1, 1, -1, 1)
    return (query.float() * ratio).to(query.dtype)

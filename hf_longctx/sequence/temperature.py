"""Query scales that depend on the token's index in the sequence: Llama 4's attention temperature, per document.

Llama 4's no-RoPE layers (`attn_temperature_tuning`, arXiv 2501.19399) scale each query by
`log1p(floor((i + 1) / floor_scale)) * attn_scale + 1`, with `i = arange(tokens given) + cached length` computed
inside the attention module: the index in the row. Run alone, a document's tokens get their index in that
document. Under SP `i` restarts at 0 on every rank (gradients 28% off at SP=2, measured), and in a packed row it
runs on across the documents (at every SP size). The query reaches hf_longctx's attention function already scaled;
this rescales it by `scale(index in its document) / scale(index the module used)` before any exchange. The scale
is at least 1, so the ratio is well defined; in float32 the result equals each document run alone to round-off
(two roundings instead of one in bf16/fp16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from hf_longctx.data.layout import layout_indices
from hf_longctx.sequence.documents import index_in_document

if TYPE_CHECKING:
    from hf_longctx.distributed.groups import SequenceParallelGroups


class GlobalPositions(Protocol):
    """What the attention layer knows of the forward (its `attention.kernels.SequenceContext`, a layer above)."""

    position_ids: torch.Tensor  # [bs or 1, sl] global positions of the whole batch
    single_document: bool  # one document per row


def _scale(index: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    return torch.log1p(torch.floor((index.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def scales_query_by_index(module: torch.nn.Module) -> bool:
    """Whether `module` scales its queries by their index in the row (Llama 4's temperature tuning)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def document_scaled_query(
    module: torch.nn.Module, query: torch.Tensor, context: GlobalPositions, layout: str, groups: SequenceParallelGroups
) -> torch.Tensor:
    """`query` `[bs, heads, sl_l, d]` of this rank's tokens, scaled by each token's index in its own document.

    Args:
        module: the attention module (its `floor_scale`, `attn_scale`).
        query: as the module scaled it, by the index `arange(sl_l)` of the tokens it was given.
        context: the forward's global positions (`position_ids` `[bs or 1, sl]`, the whole batch).
        layout, groups: which tokens of the row this rank holds.

    Returns:
        The rescaled query, in `query`'s dtype (`query` itself on one rank with one document per row).
    """
    if not groups.sp_enabled and context.single_document:
        return query
    positions, sl_l = context.position_ids, query.shape[-2]
    held = layout_indices(layout, groups.sp_rank, groups.sp_world_size, positions.shape[-1]).to(positions.device)
    index = index_in_document(positions)[:, held].to(query.device)  # [bs, sl_l]
    local = torch.arange(sl_l, device=query.device)
    ratio = (_scale(index, module) / _scale(local, module))[:, None, :, None]  # [bs, 1, sl_l, 1]
    return (query.float() * ratio).to(query.dtype)

"""Ring and hybrid (Ulysses x ring, "USP") attention as a transformers attention function.

`hybrid_attention` is the main (pure) function; `registry.py` plugs it in for `backend="ring"`
(Ulysses degree 1: the ring spans the SP group) and `backend="hybrid"`. Per layer: an all-to-all
over the Ulysses group (consecutive ranks, inside a node) turns sequence shards into head shards of
the ring rank's token set, a sort puts those tokens in global order, ring attention runs over the
ring group with the local heads, and the inverse sort and all-to-all bring the output back. GQA
follows Ulysses' head layout (the Ulysses degree divides the query heads; a kv head is replicated
only to ranks whose query heads read it, and its gradient copies are summed by the exchange's
backward).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.attention.kernels import SequenceContext, attention_chunk_size
from hf_longctx.attention.ring.attention import RingSpec, ring_attention
from hf_longctx.attention.ring.plan import VisibilityRule, plan_ring
from hf_longctx.attention.ulysses import exchange_qkv, head_layout
from hf_longctx.data.layout import ring_indices, ulysses_sort_order
from hf_longctx.distributed.comm import all_to_all
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.distributed.ring_comm import RingComm


def check_ring_model(config: Any, model: torch.nn.Module) -> None:
    """Refuse, at enable time, attention features the ring cannot make exact.

    Raises:
        ValueError: logit soft-capping or attention sinks, naming `sp_backend="ulysses"`.
    """
    softcap = getattr(config, "attn_logit_softcapping", None)
    sinks = [name for name, _ in model.named_parameters() if name.rsplit(".", 1)[-1] in ("sinks", "s_aux")]
    what = f"attention logit soft-capping ({softcap})" if softcap else ("attention sinks" if sinks else None)
    if what:
        raise ValueError(
            f"{type(model).__name__} uses {what}, which ring attention's block-wise softmax cannot reproduce "
            'exactly; use sp_backend="ulysses" (it runs the model\'s own kernel on the full sequence).'
        )


def _check_call(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError(
            'Soft-capping and attention sinks are not exact under ring attention; use sp_backend="ulysses".'
        )
    if kwargs.get("dropout", 0.0):
        raise ValueError(
            "Attention dropout > 0 is not supported by ring attention; set attention_dropout=0 in the model "
            'config (or use sp_backend="ulysses", which is not bit-exact with dropout either).'
        )
    if kwargs.get("is_causal") is False:
        raise ValueError("Ring attention implements causal (decoder) attention only; got is_causal=False.")


def _plans(context: SequenceContext, layout: str, sp: int, ulysses: int, ring_rank: int, window, chunk):
    # Cached on the forward's context: every layer with the same window/chunk shares the plans.
    key = ("ring_plans", layout, sp, ulysses, ring_rank, window, chunk)
    if key not in context._cache:
        device = context.position_ids.device
        indices = [i.to(device) for i in ring_indices(layout, sp, ulysses, context.position_ids.shape[1])]
        rule = VisibilityRule(
            doc_ids=None if context.single_document else context.doc_ids,
            window=window,
            chunk=chunk,
            position_ids=context.position_ids,
        )
        context._cache[key] = plan_ring(indices, ring_rank, rule)
    return context._cache[key]


def _sort_order(context: SequenceContext, layout: str, sp: int, ulysses: int, ring_rank: int):
    key = ("ulysses_sort", layout, sp, ulysses, ring_rank)
    if key not in context._cache:
        order = ulysses_sort_order(layout, sp, ulysses, ring_rank, context.position_ids.shape[1])
        if order is not None:
            order = order.to(context.position_ids.device)
            order = (order, torch.argsort(order))
        context._cache[key] = order
    return context._cache[key]


def hybrid_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    context: SequenceContext,
    layout: str,
    sp_world_size: int,
    ulysses: SequenceParallelGroups,
    ring: RingComm,
    variant: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the full sequence for a rank that holds one sequence shard (ring or USP).

    Args:
        module: the model's attention module (its layer type selects chunked attention).
        query: `[bs, hc, sl_l, hs]` local queries (RoPE applied with global positions).
        key: `[bs, hc_kv, sl_l, hs]` local keys.
        value: `[bs, hc_kv, sl_l, hs_v]` local values.
        context: the forward's global sequence metadata (global order).
        layout: the token layout of the shards ("contiguous" or "zigzag").
        sp_world_size: P, the SP group size.
        ulysses: the Ulysses group as `SequenceParallelGroups` (size U; U = 1: pure ring).
        ring: this rank's ring (size P / U).
        variant: "p2p" or "allgather".
        **kwargs: what the model passed (`scaling`, `sliding_window`, `dropout`, ...).

    Returns:
        `([bs, sl_l, hc, hs_v], None)`.

    Raises:
        ValueError: soft-capping, sinks, dropout > 0, non-causal attention, a shard that does not match
            the forward's global sequence, or heads not divisible by the Ulysses degree.
    """
    bs, num_heads, sl_l, _ = query.shape
    if context.position_ids.shape != (bs, sl_l * sp_world_size):
        raise ValueError(
            f"Local shard [bs={bs}, seq={sl_l}] x sp={sp_world_size} does not match the global position_ids "
            f"{tuple(context.position_ids.shape)}: build the batch with hf_longctx.shard_batch."
        )
    _check_call(module, kwargs)
    u = ulysses.sp_world_size
    q, k, v = query, key, value
    order = None
    if u > 1:
        q, k, v = exchange_qkv(query, key, value, head_layout(num_heads, key.shape[1], u), ulysses)
        order = _sort_order(context, layout, sp_world_size, u, ring.rank)
        if order is not None:
            q, k, v = (t.index_select(2, order[0]) for t in (q, k, v))  # [bs, hc / U, sl_l * U, hs] sorted
    window = kwargs.get("sliding_window")
    plans = _plans(context, layout, sp_world_size, u, ring.rank, window, attention_chunk_size(module))
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    out = ring_attention(q, k, v, RingSpec(ring, plans, float(scale), variant))  # [bs, hc / U, sl_r, hs_v]
    if order is not None:
        out = out.index_select(2, order[1])
    out = out.transpose(1, 2)  # [bs, sl_r, hc / U, hs_v]
    if u > 1:
        out = all_to_all(out, scatter_dim=1, gather_dim=2, group=ulysses.sp_group)  # [bs, sl_l, hc, hs_v]
    return out, None

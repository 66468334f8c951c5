"""Head-chunked Ulysses (UPipe's idea, arXiv 2602.21196): exchange and attend over chunks of the local heads.

Plain Ulysses turns the sequence-sharded q/k/v of all heads into full-sequence q/k/v of `heads / sp` heads,
runs the kernel and exchanges the output back; those full-sequence buffers (send and receive buffers, the
kernel's output, and what the kernel saves for backward) are the attention's largest tensors at long
context. With `ulysses_head_chunks=C` the same steps run C times, each on `heads / (sp * C)` heads, so
only one chunk's full-sequence buffers exist at a time. Every chunk keeps whole query groups with the
key/value head they read (GQA), so each head's attention is computed exactly as without chunks.

`head_chunked_attention` is the entry `attention/registry.py` calls when the option is above 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from hf_longctx.attention.kernels import SequenceContext
from hf_longctx.attention.ulysses import (
    HeadLayout,
    KernelCall,
    attend_local_heads,
    check_shard,
    head_index,
    head_layout,
)
from hf_longctx.distributed.groups import SequenceParallelGroups


def valid_head_chunks(num_heads: int, num_kv_heads: int, sp_size: int) -> list[int]:
    """Chunk counts for this model and SP size: the divisors of the key/value heads a rank receives (of its
    query heads when it receives one key/value head: MQA, or fewer key/value heads than ranks)."""
    layout = head_layout(num_heads, num_kv_heads, sp_size)
    unit = layout.kv_local if layout.kv_local > 1 else layout.q_local
    return [c for c in range(1, unit + 1) if unit % c == 0]


def check_chunks_backend(chunks: int, backend: str) -> None:
    """Refuse head chunks that are not a count >= 1, or that are set for a backend other than Ulysses."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"ulysses_head_chunks must be an integer >= 1 (1: no chunking), got {chunks!r}.")
    if chunks != 1 and backend != "ulysses":
        raise ValueError(
            f"ulysses_head_chunks={chunks} applies to sp_backend='ulysses' only, not {backend!r}: set "
            "sp_backend='ulysses' or ulysses_head_chunks=1."
        )


def check_head_chunks(num_heads: int, num_kv_heads: int, sp_size: int, chunks: int) -> None:
    """Raise a `ValueError` naming the valid counts when `chunks` does not split this rank's heads."""
    valid = valid_head_chunks(num_heads, num_kv_heads, sp_size)
    if chunks not in valid:
        layout = head_layout(num_heads, num_kv_heads, sp_size)
        raise ValueError(
            f"ulysses_head_chunks={chunks} does not split the heads each rank attends ({layout.q_local} query, "
            f"{layout.kv_local} key/value heads of {num_heads} / {num_kv_heads} at sp_size={sp_size}) into whole "
            f"query groups: set ulysses_head_chunks to one of {valid}."
        )


@dataclass(frozen=True)
class HeadChunk:
    """One chunk: the query and key/value heads to send, destination by destination, and what arrives.

    `q_index` / `kv_index` are the model's head indices, `ws` blocks of `layout.q_local` / `layout.kv_local`;
    `offset` is the chunk's first query head within a rank's local heads.
    """

    q_index: tuple[int, ...]
    kv_index: tuple[int, ...]
    layout: HeadLayout
    offset: int


@lru_cache(maxsize=64)
def head_chunks(num_heads: int, num_kv_heads: int, sp_size: int, chunks: int) -> tuple[HeadChunk, ...]:
    """Split the Ulysses exchange of `head_layout(num_heads, num_kv_heads, sp_size)` into `chunks` chunks.

    Rank r's chunk c holds its local query heads `[c * q_local / C, (c + 1) * q_local / C)` and the key/value
    heads they read: a slice of its local key/value heads, or its single one (sent with every chunk).

    Raises:
        ValueError: `chunks` is not a valid count (see `check_head_chunks`), or the head counts are invalid.
    """
    check_head_chunks(num_heads, num_kv_heads, sp_size, chunks)
    full = head_layout(num_heads, num_kv_heads, sp_size)
    ql, kl = full.q_local, full.kv_local
    sent = full.kv_index if full.kv_index is not None else tuple(range(num_kv_heads))  # ws blocks of kl
    qc, kc = ql // chunks, (kl // chunks if kl > 1 else 1)
    plans = []
    for c in range(chunks):
        q_index = tuple(r * ql + c * qc + i for r in range(sp_size) for i in range(qc))
        kv_slot = tuple(c * kc + j if kl > 1 else 0 for j in range(kc))
        kv_index = tuple(sent[r * kl + j] for r in range(sp_size) for j in kv_slot)
        plans.append(HeadChunk(q_index, kv_index, HeadLayout(qc, kc, qc // kc, None), c * qc))
    return tuple(plans)


def head_chunked_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    chunks: int,
    kernel: Callable[..., tuple[torch.Tensor, Any]],
    kernel_name: str,
    family: str,
    context: SequenceContext,
    groups: SequenceParallelGroups,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`ulysses_attention` run over `chunks` chunks of the local heads (same arguments, plus `chunks`).

    Each chunk runs under non-reentrant `torch.utils.checkpoint`: autograd keeps only the chunk's inputs,
    the sequence-sharded q/k/v that are alive anyway, and recomputes the chunk's exchange and kernel
    forward in backward. Without it every chunk's kernel would save its full-sequence q/k/v and output (and
    the log-sum-exp) until backward, all chunks together as much as unchunked Ulysses: the forward's
    transient buffers would shrink but not the saved ones, and backward's not at all. A custom autograd
    function would also work but would have to route the gradients of parameters the kernel reads
    itself (GPT-OSS sinks); the checkpoint's graph does that. The cost is one more exchange and kernel
    forward per layer in backward. Chunks run in order in backward too (autograd runs a chunk's nodes,
    created after the previous chunk's, first), so every rank issues the same collectives.

    Returns:
        `([bs, sl_l, hc, hs_v], None)`, as `ulysses_attention`.

    Raises:
        ValueError: as `ulysses_attention`, or `chunks` does not split the local heads.
    """
    ws = groups.sp_world_size
    check_shard(query, context, ws)
    call = KernelCall(module, kernel, kernel_name, family, context, groups, kwargs)
    plans = head_chunks(query.shape[1], key.shape[1], ws, chunks)
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    outs = []
    for plan in plans:

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: HeadChunk = plan) -> torch.Tensor:
            q = q.index_select(1, head_index(plan.q_index, q.device))
            k = k.index_select(1, head_index(plan.kv_index, k.device))
            v = v.index_select(1, head_index(plan.kv_index, v.device))
            first_head = groups.sp_rank * plan.layout.q_local * chunks + plan.offset
            return attend_local_heads(call, q, k, v, plan.layout, first_head)

        out = checkpoint(run, query, key, value, use_reentrant=False) if recompute else run(query, key, value)
        outs.append(out.unflatten(2, (ws, -1)))  # [bs, sl_l, ws, hc / (ws * C), hs_v]
    # Chunk c of rank r holds the model's heads r * hc / ws + c * hc / (ws * C) + i: interleave them back.
    return torch.stack(outs, dim=3).flatten(2, 4), None

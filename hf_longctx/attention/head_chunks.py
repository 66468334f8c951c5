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

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from hf_longctx.attention.kernels import SequenceContext
from hf_longctx.attention.ulysses import (
    PER_HEAD_ATTRS,
    PER_HEAD_KWARGS,
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
    """One chunk: the key/value heads to send, destination by destination, and what each rank receives.

    Rank r's chunk holds the model's query heads `r * q_local + offset + [0, layout.q_local)` (q_local: the
    rank's heads without chunks); `kv_index` lists the model's key/value heads sent, `ws` blocks of
    `layout.kv_local`.
    """

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
        kv_slot = tuple(c * kc + j if kl > 1 else 0 for j in range(kc))
        kv_index = tuple(sent[r * kl + j] for r in range(sp_size) for j in kv_slot)
        plans.append(HeadChunk(kv_index, HeadLayout(qc, kc, qc // kc, None), c * qc))
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

    In training the chunks run inside `_ChunkedHeads`, an autograd function that saves only a copy of its
    inputs (the sequence-sharded q/k/v; the model's own are then freed) and the per-head sinks, and recomputes
    each chunk's exchange and kernel forward in backward, one chunk at a time, writing each chunk's gradient
    over its part of the copy, which becomes q/k/v's gradient. Without
    that, every chunk's kernel would save its full-sequence q/k/v and output (and log-sum-exp) until backward,
    all chunks together as much as unchunked Ulysses; `torch.utils.checkpoint` per chunk avoids that but
    hands each chunk's gradient back separately (sliced selections: a full-size zero gradient per chunk;
    one split: all chunks' gradients, then their stack), so backward would peak above unchunked Ulysses.
    The cost is one more exchange and kernel forward per layer in backward. Every rank runs the same chunks
    in the same order, so the collectives match.

    Returns:
        `([bs, sl_l, hc, hs_v], None)`, as `ulysses_attention`.

    Raises:
        ValueError: as `ulysses_attention`, `chunks` does not split the local heads, or attention dropout > 0
            (a recompute would draw other dropout masks).
    """
    ws = groups.sp_world_size
    check_shard(query, context, ws)
    if kwargs.get("dropout", 0.0):
        raise ValueError(
            "ulysses_head_chunks recomputes attention in backward and does not support attention dropout > 0: "
            "set attention_dropout=0 in the model config or ulysses_head_chunks=1."
        )
    runner = _Chunks(KernelCall(module, kernel, kernel_name, family, context, groups, kwargs), query, key, chunks)
    extras = runner.per_head_tensors()
    if not torch.is_grad_enabled():
        return runner.forward(*runner.prepare(query, key, value, copy=False), extras), None
    return _ChunkedHeads.apply(runner, query, key, value, *extras.values()), None


class _Chunks:
    """The chunks of one attention call: their inputs, their attention, and where their gradients go."""

    def __init__(self, call: KernelCall, query: torch.Tensor, key: torch.Tensor, chunks: int) -> None:
        ws = call.groups.sp_world_size
        self.call, self.ws, self.chunks = call, ws, chunks
        self.plans = head_chunks(query.shape[1], key.shape[1], ws, chunks)
        full = head_layout(query.shape[1], key.shape[1], ws)
        self.q_local = full.q_local
        # Each chunk's kv heads a slice of the rank's own (plain), or picked by index (replicated / copied).
        self.plain_kv = full.kv_index is None and full.kv_local > 1
        self.kv_index = sum((plan.kv_index for plan in self.plans), ())  # chunk-major, when not plain

    def per_head_tensors(self) -> dict[str, torch.Tensor]:
        """The per-query-head tensors the kernel reads (sinks): module attributes and keyword arguments."""
        found = {}
        for name in PER_HEAD_ATTRS:
            value = getattr(self.call.module, name, None)
            if isinstance(value, torch.Tensor):
                found[f"attr:{name}"] = value
        for name in PER_HEAD_KWARGS:
            if isinstance(self.call.kwargs.get(name), torch.Tensor):
                found[f"kwarg:{name}"] = self.call.kwargs[name]
        return found

    def _q(self, x: torch.Tensor, c: int) -> torch.Tensor:
        """Chunk c's view of a `[bs, hc, ...]` query-head tensor as `[bs, ws, hc / (ws * C), ...]`."""
        return x.unflatten(1, (self.ws, self.chunks, -1))[:, :, c]

    def prepare(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, copy: bool) -> list[torch.Tensor]:
        """The buffers the chunks read: q, k, v themselves (`copy=False`) or private copies (backward writes
        each chunk's gradient over the chunk's inputs once it is done with them); gathered key/value heads
        (all chunks, chunk-major) when they are not a plain split."""
        if self.plain_kv:
            return [t.clone() if copy else t for t in (query, key, value)]
        index = head_index(self.kv_index, key.device)
        return [query.clone() if copy else query, key.index_select(1, index), value.index_select(1, index)]

    def _kv(self, x: torch.Tensor, c: int) -> torch.Tensor:
        if self.plain_kv:
            return self._q(x, c)
        width = x.shape[1] // self.chunks
        return x[:, c * width : (c + 1) * width]

    def inputs(self, c: int, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """Chunk c's q/k/v as `exchange_qkv` sends them, views of `prepare`'s buffers: `[bs, ws, heads of the
        chunk per rank, sl_l, hs]`, or `[bs, ws * heads, sl_l, hs]` for gathered key/value heads."""
        q, k, v = buffers
        return [self._q(q, c), self._kv(k, c), self._kv(v, c)]

    def attend(self, c: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: dict) -> torch.Tensor:
        """Chunk c's exchange, kernel and exchange back: `[bs, sl_l, ws * heads of the chunk, hs_v]`."""
        plan, call = self.plans[c], self.call
        kwargs = {**call.kwargs, **{k_[6:]: t for k_, t in extras.items() if k_.startswith("kwarg:")}}
        attrs = {k_[5:]: t for k_, t in extras.items() if k_.startswith("attr:")}
        call = dataclasses.replace(call, kwargs=kwargs, attrs=attrs)
        first_head = call.groups.sp_rank * self.q_local + plan.offset
        return attend_local_heads(call, q, k, v, plan.layout, first_head)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, extras: dict) -> torch.Tensor:
        """All chunks over `prepare`'s buffers, written into one `[bs, sl_l, hc, hs_v]` output."""
        out = None
        for c in range(self.chunks):
            part = self.attend(c, *self.inputs(c, [query, key, value]), extras)  # [bs, sl_l, ws * hc_c, hs_v]
            if out is None:
                out = part.new_empty(part.shape[0], part.shape[1], query.shape[1], part.shape[-1])
            # Chunk c of rank r holds the model's heads r * hc / ws + c * hc / (ws * C) + i.
            self._q(out.transpose(1, 2), c).copy_(part.transpose(1, 2).unflatten(1, (self.ws, -1)))
        return out

    def input_grads(self, buffers: list[torch.Tensor], key_shape: torch.Size) -> list[torch.Tensor]:
        """q/k/v's gradients from `prepare`'s buffers once every chunk wrote its gradients into them."""
        if self.plain_kv:
            return buffers
        index = head_index(self.kv_index, buffers[1].device)
        return [buffers[0], *(b.new_zeros(key_shape).index_add_(1, index, b) for b in buffers[1:])]


class _ChunkedHeads(torch.autograd.Function):
    """The chunks in forward without a graph; in backward each chunk recomputed, then differentiated.

    Saved: private copies of q/k/v (`_Chunks.prepare`; the originals are freed when the caller drops them) and
    the per-head tensors. Backward overwrites chunk c's part of the copies with chunk c's gradient as soon as
    chunk c is done, so the copies become q/k/v's gradients without another q/k/v-sized buffer.
    """

    @staticmethod
    def forward(ctx, runner: _Chunks, query, key, value, *extras):
        buffers = runner.prepare(query, key, value, copy=True)
        ctx.runner, ctx.key_shape = runner, key.shape
        ctx.save_for_backward(*buffers, *extras)
        with torch.no_grad():
            return runner.forward(*buffers, dict(zip(runner.per_head_tensors(), extras, strict=True)))

    @staticmethod
    def backward(ctx, grad_out):
        runner: _Chunks = ctx.runner
        saved = ctx.saved_tensors
        buffers, extras = list(saved[:3]), list(saved[3:])
        wanted = ctx.needs_input_grad[1:]
        extra_grads = [torch.zeros_like(t) if w else None for t, w in zip(extras, wanted[3:], strict=True)]
        grad_heads = grad_out.transpose(1, 2)  # [bs, hc, sl_l, hs_v], a view
        for c in range(runner.chunks):
            grads = _chunk_backward(runner, c, grad_heads, buffers, extras, wanted)
            with torch.no_grad():
                for target, grad, w in zip(runner.inputs(c, buffers), grads[:3], wanted[:3], strict=True):
                    if w and grad is not None:
                        target.copy_(grad)
                    elif w:  # unused by the chunk: zero, not the input left in the buffer
                        target.zero_()
                for total, grad in zip(extra_grads, grads[3:], strict=True):
                    if total is not None and grad is not None:
                        total.add_(grad)
        qkv = runner.input_grads(buffers, ctx.key_shape)
        return (None, *(g if w else None for g, w in zip(qkv, wanted[:3], strict=True)), *extra_grads)


def _chunk_backward(runner: _Chunks, c: int, grad_heads: torch.Tensor, buffers: list, extras: list, wanted) -> list:
    """Chunk c recomputed and differentiated: the gradients of its q/k/v (`_Chunks.inputs`) and of the per-head
    tensors, None where none is wanted. A function of its own so that the chunk's tensors are freed when it
    returns, before the next chunk runs."""
    names = list(runner.per_head_tensors())
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(w) for t, w in zip(runner.inputs(c, buffers), wanted[:3], strict=True)]
        local = [t.detach().requires_grad_(w) for t, w in zip(extras, wanted[3:], strict=True)]
        out = runner.attend(c, *inputs, dict(zip(names, local, strict=True)))
    leaves = [*inputs, *local]
    needed = [t for t in leaves if t.requires_grad]
    if not needed:
        return [None] * len(leaves)
    upstream = runner._q(grad_heads, c).flatten(1, 2).transpose(1, 2)  # [bs, sl_l, ws * hc_c, hs_v]
    found = iter(torch.autograd.grad(out, needed, upstream, allow_unused=True))
    return [next(found) if t.requires_grad else None for t in leaves]

"""Ring attention over one ring of ranks: the autograd function (forward and backward by hand).

`ring_attention(q, k, v, spec)` is the main entry. Each ring rank keeps its queries; key/value
blocks either travel around the ring ("p2p", pass-KV: the next block is in flight while the current
one computes, O(S/R) memory) or are all-gathered once per layer ("allgather": one collective each
way, O(S) transient memory). Every block's (out, LSE) from a block kernel (`attention/lse/`) is merged
in fp32 (fp64 for fp64 inputs) as planned by `plan.py`.

Backward (the exactness argument): with the *global* output O and LSE L of a row, the softmax
gradient splits over key blocks exactly (D_i = rowsum(dO_i * O_i) of the global O; P_ij =
exp(s_ij - L_i) globally normalised), so every block's kernel backward called with the global O and
L returns exact partial gradients; dQ sums them locally, dK/dV travel with their block in an fp32
accumulator ("p2p": one hop per step, the last hop delivers it to its owner) or are summed by a
reduce-scatter ("allgather"). Only local q, k, v, the merged O and L are saved; K/V blocks are
communicated again in backward instead of being kept (O(S) memory per layer otherwise).

Precision in bf16 / fp16: every block kernel returns its output and its dq / dk / dv piece rounded to the input
dtype, so beyond the whole-row kernel's own error a gradient element carries at most `u * sum_j |g_j|` (its exact
pieces g_j from the ring's blocks; at most `P u max_j |g_j|`; u = 2^-8 in bf16, 2^-11 in fp16) and an output element
`u * max |V|`; tests/unit/test_ring_numerics.py holds P = 2, 4 and 8 to that bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hf_longctx.attention.lse.choose import select_kernel
from hf_longctx.attention.lse.contract import lse_dtype
from hf_longctx.attention.lse.merge import merge_block
from hf_longctx.attention.ring.block import BlockPlan
from hf_longctx.distributed.ring_comm import RingComm
from hf_longctx.instrument.measure import CollectiveStats, active_recorder

VARIANTS = ("p2p", "allgather")
_TAG_KV, _TAG_GRAD = 0, 1  # gloo matches in-flight messages between two ranks by tag


def check_variant(variant: str) -> None:
    """Raise a `ValueError` naming the ring variants."""
    if variant not in VARIANTS:
        raise ValueError(f"Unknown ring_variant {variant!r}; choose one of {list(VARIANTS)}.")


@dataclass(frozen=True)
class RingSpec:
    """Everything the autograd function needs besides tensors (no hidden state between calls).

    `plans[i]` are the kernel calls of this rank's queries against ring rank i's keys (none: skip)."""

    comm: RingComm
    plans: tuple[tuple[BlockPlan, ...], ...]
    scale: float
    variant: str = "p2p"


class _KV:
    """k and v (or their gradients) of one block in one flat buffer: one message per hop."""

    def __init__(self, k_shape: torch.Size, v_shape: torch.Size) -> None:
        self.k_shape, self.v_shape = k_shape, v_shape
        self.nk = math.prod(k_shape)
        self.numel = self.nk + math.prod(v_shape)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.cat([k.reshape(-1), v.reshape(-1)])

    def unpack(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return flat[: self.nk].view(self.k_shape), flat[self.nk :].view(self.v_shape)


def _kernel(q: torch.Tensor, v: torch.Tensor, plan: BlockPlan):
    return select_kernel(q, plan, v.shape[-1])


def _blocks(flat: torch.Tensor, spec: RingSpec, stats: CollectiveStats | None) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield `(source ring rank, its flat k/v)` in ring order; p2p sends the next block meanwhile."""
    comm = spec.comm
    gathered = comm.all_gather(flat, stats) if spec.variant == "allgather" else None
    for step in range(comm.size):
        src = (comm.rank - step) % comm.size
        if gathered is not None:
            yield src, gathered[src]
            continue
        pending = comm.exchange(flat, _TAG_KV, stats) if step < comm.size - 1 else None
        yield src, flat
        if pending is not None:
            flat = pending.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec) -> torch.Tensor:
        stats = active_recorder()
        acc = lse_dtype(q.dtype)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)  # [bs, hc, sl, hs_v]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # [bs, hc, sl]
        kv = _KV(k.shape, v.shape)
        for src, flat in _blocks(kv.pack(k, v), spec, stats):
            kb, vb = kv.unpack(flat)
            for plan in spec.plans[src]:
                b = plan.batch_rows
                block_out, block_lse = _kernel(q, v, plan).forward(
                    q[b, :, plan.rows],
                    kb[b, :, plan.cols],
                    vb[b, :, plan.cols],
                    causal=plan.causal,
                    allowed=plan.allowed,
                    scale=spec.scale,
                    segments=plan.segments,
                )
                merge_block(out[b], lse[b], block_out, block_lse, plan.rows)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.stats = spec, stats
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        spec, stats, comm = ctx.spec, ctx.stats, ctx.spec.comm
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
        kv = _KV(k.shape, v.shape)

        def block_grads(src: int, flat: torch.Tensor) -> list:
            kb, vb = kv.unpack(flat)
            results = []
            for plan in spec.plans[src]:
                b, r, c = plan.batch_rows, plan.rows, plan.cols
                grads = _kernel(q, v, plan).backward(
                    dout[b, :, r],
                    q[b, :, r],
                    kb[b, :, c],
                    vb[b, :, c],
                    out[b, :, r],
                    lse[b, :, r],
                    causal=plan.causal,
                    allowed=plan.allowed,
                    scale=spec.scale,
                    segments=plan.segments,
                )
                dq[b, :, r] += grads[0]
                results.append((plan, grads))
            return results

        def add_kv_grads(acc_flat: torch.Tensor, results: list) -> None:
            dk_acc, dv_acc = kv.unpack(acc_flat)
            for plan, (_, gk, gv) in results:
                dk_acc[plan.batch_rows, :, plan.cols] += gk
                dv_acc[plan.batch_rows, :, plan.cols] += gv

        if spec.variant == "allgather":
            # All blocks' dK/dV land in one [R, k + v] fp32 buffer; block i is summed onto rank i.
            grads = torch.zeros((comm.size, kv.numel), dtype=lse.dtype, device=q.device)
            for src, flat in _blocks(kv.pack(k, v), spec, stats):
                add_kv_grads(grads[src], block_grads(src, flat))
            dk, dv = kv.unpack(comm.reduce_scatter(grads, stats))
        else:
            # The fp32 dK/dV accumulator of the block held at each step travels with it: received
            # from rank - 1 for the next block, sent on to rank + 1; after R hops it is back home.
            acc_flat = torch.zeros(kv.numel, dtype=lse.dtype, device=q.device)
            pending = None
            for src, flat in _blocks(kv.pack(k, v), spec, stats):
                result = block_grads(src, flat)  # computes while the accumulator is in flight
                if pending is not None:
                    acc_flat = pending.wait()
                add_kv_grads(acc_flat, result)
                pending = comm.exchange(acc_flat, _TAG_GRAD, stats)
            dk, dv = kv.unpack(pending.wait())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: RingSpec) -> torch.Tensor:
    """Exact attention of this ring rank's queries over the keys of every ring rank.

    Args:
        q: `[bs, hc, sl_r, hs]` queries of this ring rank's tokens (increasing global positions).
        k: `[bs, hc_kv, sl_r, hs]` its keys (`hc % hc_kv == 0`: GQA/MQA native).
        v: `[bs, hc_kv, sl_r, hs_v]` its values.
        spec: the ring, the block plans and the softmax scale.

    Returns:
        `[bs, hc, sl_r, hs_v]` in q's dtype.
    """
    check_variant(spec.variant)
    if len(spec.plans) != spec.comm.size:
        raise ValueError(f"{len(spec.plans)} block plans for a ring of {spec.comm.size} ranks.")
    return _RingAttention.apply(q, k, v, spec)

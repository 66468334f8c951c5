"""Attention of one query tile against the whole sequence's keys, with per-document causal masks.

`tile_attention(q, k, v, pieces, scale)` is the main entry, used by `tiled_layer`. A tile's queries
attend, inside their document, to every earlier key: per (row, document) that is a fully visible
prefix `[doc start, tile start)` plus a square causal block on the diagonal. Both run on the LSE
block kernels of ring attention (`attention/lse/`) and are merged by log-sum-exp, so no mask
is ever built. Backward calls each piece's kernel backward with the merged output and LSE, which
gives exact partial gradients (the ring's argument).

dK/dV do not go back through autograd tile by tile: every piece of every tile of a layer adds its
gradients to one float32 `KVGradients` over the keys it read, and `release_kv` hands the sum to K/V's
graph once, after the layer's last tile. A kernel over the whole sequence sums its query blocks in
float32 the same way; autograd would instead add one whole-length bf16 gradient per tile (a rounding per
tile, and a zero-fill and a sum over every key for each of them).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from hf_longctx.attention.lse.choose import choose_kernel
from hf_longctx.attention.lse.contract import lse_dtype
from hf_longctx.attention.lse.merge import merge_block
from hf_longctx.memory.tile_split import GradientSum, release


@dataclass(frozen=True)
class Piece:
    """Queries `[q0, q1)` of the tile buffer (row `row`) attend keys `[k0, k1)`; `causal`: a square block."""

    row: int
    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


def plan_pieces(segments: list[list[tuple[int, int]]], spans: list[tuple[int, int, int]]) -> tuple[Piece, ...]:
    """The kernel calls of one query tile.

    Args:
        segments: per row, the `[start, end)` global ranges that attend only among themselves
            (`SequenceContext.segments()`).
        spans: the runs of the query buffer as `(buffer offset, first global position, length)`
            (one run without SP; one per SP rank after a Ulysses exchange).

    Returns:
        The pieces; every query lies in exactly one causal piece, and in at most one prefix piece.
    """
    pieces: list[Piece] = []
    for row, segs in enumerate(segments):
        ends = [end for _, end in segs]
        for offset, first, length in spans:
            last = first + length
            for s, e in segs[bisect.bisect_right(ends, first) :]:
                if s >= last:
                    break
                a, b = max(s, first), min(e, last)
                q0, q1 = offset + a - first, offset + b - first
                if a > s:
                    pieces.append(Piece(row, q0, q1, s, a, causal=False))
                pieces.append(Piece(row, q0, q1, a, b, causal=True))
    return tuple(pieces)


class KVGradients:
    """dK/dV of one layer call, summed over its tiles' pieces in float32 (float64 for float64 K/V); set up by
    `release_kv`."""

    def __init__(self) -> None:
        self.sums: tuple[GradientSum, ...] = ()

    def add(self, row: slice, keys: slice, gk: torch.Tensor, gv: torch.Tensor) -> None:
        dk, dv = self.sums
        dk.add((row, slice(None), keys), gk)
        dv.add((row, slice(None), keys), gv)


def release_kv(k: torch.Tensor, v: torch.Tensor, grads: KVGradients) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for a layer's `tile_attention` calls, whose dK/dV reach `k` and `v` once, summed in `grads`: its
    backward runs once every tile's has (they are its only consumers)."""
    grads.sums = (GradientSum(k, lse_dtype(k.dtype)), GradientSum(v, lse_dtype(v.dtype)))
    return release((k, v), grads.sums)


def _kernel(q: torch.Tensor, v: torch.Tensor):
    return choose_kernel(q.device.type, q.dtype, masked=False, head_dims=(q.shape[-1], v.shape[-1]))


class _TileAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pieces: tuple[Piece, ...], scale: float, grads: KVGradients):
        acc = lse_dtype(q.dtype)
        out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)  # [bs, hc, sq, hs_v]
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # [bs, hc, sq]
        kernel = _kernel(q, v)
        for p in pieces:
            r, keys = slice(p.row, p.row + 1), slice(p.k0, p.k1)
            piece_out, piece_lse = kernel.forward(
                q[r, :, p.q0 : p.q1], k[r, :, keys], v[r, :, keys], causal=p.causal, allowed=None, scale=scale
            )
            merge_block(out[r], lse[r], piece_out, piece_lse, slice(p.q0, p.q1))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pieces, ctx.scale, ctx.grads = pieces, scale, grads
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)  # one tile: rows can be in two pieces
        kernel = _kernel(q, v)
        for p in ctx.pieces:
            r, rows, keys = slice(p.row, p.row + 1), slice(p.q0, p.q1), slice(p.k0, p.k1)
            gq, gk, gv = kernel.backward(
                dout[r, :, rows],
                q[r, :, rows],
                k[r, :, keys],
                v[r, :, keys],
                out[r, :, rows],
                lse[r, :, rows],
                causal=p.causal,
                allowed=None,
                scale=ctx.scale,
            )
            dq[r, :, rows] += gq
            ctx.grads.add(r, keys, gk, gv)
        return dq.to(q.dtype), None, None, None, None, None


def tile_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pieces: tuple[Piece, ...],
    scale: float,
    grads: KVGradients,
) -> torch.Tensor:
    """Exact softmax attention of a query tile over the whole sequence's keys.

    Args:
        q: `[bs, hc, sq, hs]` the tile's queries (RoPE applied with global positions).
        k: `[bs, hc_kv, sl, hs]` keys of the whole sequence (`hc % hc_kv == 0`), from `release_kv`.
        v: `[bs, hc_kv, sl, hs_v]` values of the whole sequence, from `release_kv`.
        pieces: `plan_pieces` of the tile.
        scale: the softmax scale.
        grads: the `KVGradients` given to `release_kv`: the tile's dK/dV are added there.

    Returns:
        `[bs, hc, sq, hs_v]` in q's dtype; its backward returns dq (dK/dV go to `grads`).
    """
    return _TileAttention.apply(q, k, v, pieces, scale, grads)

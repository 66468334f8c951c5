"""Attention of one query tile against the whole sequence's keys, with per-document causal masks.

`tile_attention(q, k, v, pieces, scale)` is the main entry, used by `tiled_layer`. A tile's queries
attend, inside their document, to every earlier key: per (row, document) that is a fully visible
prefix `[doc start, tile start)` plus a square causal block on the diagonal. Both run on the LSE
kernels of ring attention (`attention/ring/lse_kernels.py`) and are merged by log-sum-exp, so no mask
is ever built. Backward calls each piece's kernel backward with the merged output and LSE, which
gives exact partial gradients (the ring's argument); dK/dV come back full length for autograd to sum
over tiles. When no two pieces of a row read the same keys (one query run: no SP, or a tile that one
rank holds), each piece's kernel writes its dK/dV straight into its slice of those full-length
gradients (flash-attn writes them itself; the slices are K/V's dtype, so no float32 accumulator is
needed: each key gets one piece's gradient); under Ulysses the ranks' runs overlap in their document
prefixes, and the pieces are summed in a float32 accumulator.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch

from hf_longctx.attention.ring.lse_kernels import choose_kernel, lse_dtype
from hf_longctx.attention.ring.plan import merge_block


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


def keys_disjoint(pieces: tuple[Piece, ...]) -> bool:
    """Whether no two pieces of a row read the same key (then each key's gradient comes from one piece)."""
    by_row: dict[int, list[tuple[int, int]]] = {}
    for p in pieces:
        by_row.setdefault(p.row, []).append((p.k0, p.k1))
    for spans in by_row.values():
        spans.sort()
        if any(a1 > b0 for (_, a1), (b0, _) in itertools.pairwise(spans)):
            return False
    return True


def _kernel(q: torch.Tensor, v: torch.Tensor):
    return choose_kernel(q.device.type, q.dtype, masked=False, same_head_size=q.shape[-1] == v.shape[-1])


class _TileAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: tuple[Piece, ...], scale: float):
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
        ctx.pieces, ctx.scale = pieces, scale
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        acc = lse.dtype
        direct = keys_disjoint(ctx.pieces)  # dK/dV written in place, in K/V's dtype (module docstring)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # one tile: rows can be in two pieces
        dk = torch.zeros(k.shape, dtype=k.dtype if direct else acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=v.dtype if direct else acc, device=v.device)
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
                into=(dk[r, :, keys], dv[r, :, keys]) if direct else None,
            )
            dq[r, :, rows] += gq
            if not direct:
                dk[r, :, keys] += gk
                dv[r, :, keys] += gv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def tile_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: tuple[Piece, ...], scale: float
) -> torch.Tensor:
    """Exact softmax attention of a query tile over the whole sequence's keys.

    Args:
        q: `[bs, hc, sq, hs]` the tile's queries (RoPE applied with global positions).
        k: `[bs, hc_kv, sl, hs]` keys of the whole sequence (`hc % hc_kv == 0`).
        v: `[bs, hc_kv, sl, hs_v]` values of the whole sequence.
        pieces: `plan_pieces` of the tile.
        scale: the softmax scale.

    Returns:
        `[bs, hc, sq, hs_v]` in q's dtype.
    """
    return _TileAttention.apply(q, k, v, pieces, scale)

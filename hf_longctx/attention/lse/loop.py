"""Packed blocks on a kernel without a varlen entry, one call per segment: `segment_loop(kernel)`.

torch's CPU flash kernel and the memory-efficient CUDA kernel take a dense mask but no `cu_seqlens`; the mask
a packed block's segments stand for is `[rows, columns]` of the block (a `[S / P, S / P]` tensor per block pair
for one long document split across ranks, or for chunked layers). Each segment is fully visible or square
causal, so it needs no mask at all: the kernel runs on each segment's gathered tokens with its causal flag, and
`VarlenKernel` scatters the results back. The calls are as many as the segments (documents or chunks meeting in
the block), each as long as its segment.
"""

from __future__ import annotations

import torch

from hf_longctx.attention.lse.contract import BlockKernel, lse_dtype
from hf_longctx.attention.lse.varlen import VarlenKernel


def _one(t: torch.Tensor) -> torch.Tensor:
    """Tokens-first `[n, h, d]` -> the kernels' `[1, h, n, d]` (a view)."""
    return t.transpose(0, 1).unsqueeze(0)


def _bounds(segments) -> list[tuple[int, int, int, int]]:
    cu_q, cu_k = segments.cu_q.tolist(), segments.cu_k.tolist()
    return list(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True))


def segment_loop(kernel: BlockKernel) -> VarlenKernel:
    """`kernel` (a dense block kernel: causal flag, no mask needed) run segment by segment as a varlen kernel."""

    def call_fwd(q, k, v, segments, scale):
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])  # [Tq, hc, dv]
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        for a, b, c, d in _bounds(segments):
            o, s = kernel.forward(
                _one(q[a:b]), _one(k[c:d]), _one(v[c:d]), causal=segments.causal, allowed=None, scale=scale
            )
            out[a:b] = o[0].transpose(0, 1)
            lse[:, a:b] = s[0]
        return out, lse

    def call_bwd(dout, q, k, v, out, lse, segments, scale):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, d in _bounds(segments):
            gq, gk, gv = kernel.backward(
                _one(dout[a:b]), _one(q[a:b]), _one(k[c:d]), _one(v[c:d]), _one(out[a:b]), lse[None, :, a:b],
                causal=segments.causal, allowed=None, scale=scale,
            )  # fmt: skip
            dq[a:b], dk[c:d], dv[c:d] = gq[0].transpose(0, 1), gk[0].transpose(0, 1), gv[0].transpose(0, 1)
        return dq, dk, dv

    return VarlenKernel(f"{kernel.name}_segments", call_fwd, call_bwd)

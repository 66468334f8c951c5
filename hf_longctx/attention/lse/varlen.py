"""Packed blocks on a varlen kernel: only the rows of some segment are gathered and computed (`VarlenKernel`).

O(block) memory and no mask; a row of no segment is never computed, so its out is 0 and its LSE -inf by
construction. The backward scatters dq/dk/dv back. `call_fwd` / `call_bwd` adapt one kernel API: torch's
FlashAttention-2 (`torch_flash.py`) or flash-attn's (`flash_attn.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.attention.lse.contract import lse_dtype


def tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[bs, h, n, d] -> the listed tokens of the row-major (b, n) numbering, [T, h, d] (contiguous)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]).index_select(0, index)


def untokens(t: torch.Tensor, index: torch.Tensor, bs: int, n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Inverse of `tokens`: [T, h, d] -> [bs, h, n, d] in `dtype` (default t's), zero where no token was listed and
    summed where one was listed more than once (a key that several query runs of its document see)."""
    full = torch.zeros((bs * n, *t.shape[1:]), dtype=dtype or t.dtype, device=t.device)
    full.index_add_(0, index, t.to(full.dtype))
    return full.view(bs, n, *t.shape[1:]).transpose(1, 2)


class VarlenKernel:
    """A varlen kernel on a block's `Segments`.

    `call_fwd(q, k, v, segments, scale) -> (out [Tq, hc, dv], lse [hc, Tq])` and
    `call_bwd(dout, q, k, v, out, lse [hc, Tq] contiguous, segments, scale) -> (dq, dk, dv)`, tokens-first; LSE
    and the dk/dv sums in `lse_dtype` (float32, float64 for float64 inputs: a key listed in several segments
    gets their sum).
    """

    def __init__(self, name: str, call_fwd: Callable[..., Any], call_bwd: Callable[..., Any]) -> None:
        self.name, self._call_fwd, self._call_bwd = name, call_fwd, call_bwd

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        if segments is None:
            raise ValueError(f"{self.name} runs packed blocks only (a plan with segments).")
        bs, hc, nr = q.shape[:3]
        qt, kt, vt = tokens(q, segments.q_tokens), tokens(k, segments.k_tokens), tokens(v, segments.k_tokens)
        out_t, lse_t = self._call_fwd(qt, kt, vt, segments, scale)
        out = untokens(out_t[..., : v.shape[-1]], segments.q_tokens, bs, nr)
        lse = torch.full((hc, bs * nr), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        lse.index_copy_(1, segments.q_tokens, lse_t.to(lse.dtype))
        return out, lse.view(hc, bs, nr).transpose(0, 1).contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        bs, hc, nr = q.shape[:3]
        qi, ki = segments.q_tokens, segments.k_tokens
        acc = lse_dtype(q.dtype)
        lse_t = lse.to(acc).transpose(0, 1).reshape(hc, -1).index_select(1, qi).contiguous()
        grads = self._call_bwd(
            tokens(dout, qi), tokens(q, qi), tokens(k, ki), tokens(v, ki), tokens(out, qi), lse_t, segments, scale
        )
        nc = k.shape[2]  # a key's pieces from several segments are summed in `acc`
        return untokens(grads[0], qi, bs, nr), untokens(grads[1], ki, bs, nc, acc), untokens(grads[2], ki, bs, nc, acc)


def segment_arguments(seg: Any) -> dict[str, Any]:
    """The varlen keyword arguments of `seg` (flash-attn's names)."""
    return {"cu_seqlens_q": seg.cu_q, "cu_seqlens_k": seg.cu_k, "max_seqlen_q": seg.max_q, "max_seqlen_k": seg.max_k}

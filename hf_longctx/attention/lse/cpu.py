"""Block kernels that run anywhere: torch's CPU flash kernel and the math kernel (the fallback and the reference).

torch's CPU flash ops (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward) take `[B, H, S, D]` in
any strides, GQA natively, an additive float mask (boolean masks are refused), and return LSE `[B, H, Sq]` in
float32 for fp16/bf16/fp32 inputs (fp64 for fp64). A fully masked row gets LSE 0, which `clear_empty_rows` turns
into -inf.
"""

from __future__ import annotations

import torch

from hf_longctx.attention.lse.contract import backward_lse, clear_empty_rows, dense_mask, lse_dtype, no_segments


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if allowed is None:
        return None
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, float("-inf"))


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


class CpuFlashKernel:
    """torch's CPU flash kernel. It needs one head size for q, k and v, so a value head size that
    differs (MLA) is zero-padded: padded value columns give zero outputs and are sliced off, and the
    scores (hence LSE) do not change."""

    name = "cpu_flash"

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        no_segments(segments)
        dv, d = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = (_pad_last(t.contiguous(), d) for t in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale
        )
        return clear_empty_rows(out[..., :dv], lse.to(lse_dtype(q.dtype)).contiguous(), allowed)

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        no_segments(segments)
        dq_size, dv, d = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v, out, dout = (_pad_last(t.contiguous(), d) for t in (q, k, v, out, dout))
        # The backward wants the LSE in the dtype its forward returns (float32 below float64).
        lse = backward_lse(lse.to(lse_dtype(q.dtype))).contiguous()
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale
        )
        return gq[..., :dq_size], gk[..., :dq_size], gv[..., :dv]


class MathKernel:
    """Explicit masked softmax in float32 (float64 for float64 inputs) with the closed-form flash
    backward; O(sq x sk) memory, so only a fallback and a reference. Empty rows get out 0, LSE -inf."""

    name = "math"

    @staticmethod
    def _scores(q, k, causal, allowed, scale):
        acc = lse_dtype(q.dtype)
        group = q.shape[1] // k.shape[1]
        kx = k.to(acc).repeat_interleave(group, dim=1)
        s = torch.matmul(q.to(acc), kx.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        return s, group

    @staticmethod
    def _probs(s, lse):
        safe = lse.masked_fill(lse == float("-inf"), 0.0)
        return torch.exp(s - safe.unsqueeze(-1))

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        s, group = self._scores(q, k, causal, dense_mask(q, k, allowed, segments), scale)
        lse = torch.logsumexp(s, dim=-1)
        p = self._probs(s, lse)
        out = torch.matmul(p, v.to(s.dtype).repeat_interleave(group, dim=1))
        return out.to(q.dtype), lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        s, group = self._scores(q, k, causal, dense_mask(q, k, allowed, segments), scale)
        p = self._probs(s, lse.to(s.dtype))
        acc = s.dtype
        vx = v.to(acc).repeat_interleave(group, dim=1)
        do = dout.to(acc)
        dp = torch.matmul(do, vx.transpose(-1, -2))
        delta = (do * out.to(acc)).sum(-1, keepdim=True)  # D from the global output
        ds = p * (dp - delta)
        gq = torch.matmul(ds, k.to(acc).repeat_interleave(group, dim=1)) * scale
        gk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        gv = torch.matmul(p.transpose(-1, -2), do)
        hc_kv = k.shape[1]
        gk = gk.unflatten(1, (hc_kv, group)).sum(2)
        gv = gv.unflatten(1, (hc_kv, group)).sum(2)
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)

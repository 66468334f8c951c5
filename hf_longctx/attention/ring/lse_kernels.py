"""Attention kernels that return the log-sum-exp (LSE), for ring attention's block-wise softmax.

Every adapter takes and returns one layout: q `[bs, hc, sq, hs]`, k/v `[bs, hc_kv, sk, hs]` (GQA:
`hc % hc_kv == 0`, query head h reads kv head `h // (hc / hc_kv)`), out `[bs, hc, sq, hs_v]` in q's
dtype and LSE `[bs, hc, sq]` contiguous, natural log, in `lse_dtype(q.dtype)` (float64 for float64
inputs, else float32). `allowed` is an optional boolean `[bs, 1, sq, sk]` mask and `segments` the
varlen form of a packed block (`plan.Segments`; mask kernels turn it into a mask); `causal` is only
ever asked for square blocks, so top-left vs bottom-right alignment never matters. A row without
any visible key may come back with any LSE (and, from a mask kernel, any output): the ring sets its
LSE to -inf and the merge ignores its output. The backward takes the *global* out and LSE (the
merged ones), which makes the per-block gradients exact partial sums.

`select_kernel(q, plan)` is the main entry (`choose_kernel` decides from device and dtype, and logs
each choice once). CPU: torch's flash kernel (`_scaled_dot_product_flash_attention_for_cpu` and its
backward). CUDA: `cuda_kernels.py` (flash-attn / torch varlen flash / memory-efficient).
`MathKernel` (explicit softmax, closed-form backward) runs anywhere and is the fallback.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Protocol

import torch

from hf_longctx.attention.ring.cuda_kernels import (
    TORCH_VARLEN,
    CudaEfficientKernel,
    FlashAttnKernel,
    VarlenKernel,
    detect_flash_attn,
)
from hf_longctx.attention.ring.plan import BlockPlan, Segments

logger = logging.getLogger(__name__)

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator / LSE dtype: float64 keeps float64 references meaningful, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockKernel(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        allowed: torch.Tensor | None,
        scale: float,
        segments: Segments | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        allowed: torch.Tensor | None,
        scale: float,
        segments: Segments | None = None,
    ) -> Grads: ...


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if allowed is None:
        return None
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, float("-inf"))


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def _dense(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, segments: Segments | None):
    """The boolean mask a mask kernel applies: `allowed`, or the one the varlen segments stand for."""
    if allowed is None and segments is not None:
        return segments.mask(q.shape[0], q.shape[2], k.shape[2])
    return allowed


class CpuFlashKernel:
    """torch's CPU flash kernel. It needs one head size for q, k and v, so a value head size that
    differs (MLA) is zero-padded: padded value columns give zero outputs and are sliced off, and the
    scores (hence LSE) do not change. It rejects boolean masks, so `allowed` becomes 0 / -inf."""

    name = "cpu_flash"

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        allowed = _dense(q, k, allowed, segments)
        dv, d = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = (_pad_last(t.contiguous(), d) for t in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale
        )
        return out[..., :dv], lse.to(lse_dtype(q.dtype)).contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        allowed = _dense(q, k, allowed, segments)
        dq_size, dv, d = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v, out, dout = (_pad_last(t.contiguous(), d) for t in (q, k, v, out, dout))
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale
        )
        return gq[..., :dq_size], gk[..., :dq_size], gv[..., :dv]


class MathKernel:
    """Explicit masked softmax in float32 (float64 for float64 inputs) with the closed-form flash
    backward; O(sq x sk) memory, so only a fallback and a reference. Empty rows get LSE = -inf."""

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
        s, group = self._scores(q, k, causal, _dense(q, k, allowed, segments), scale)
        lse = torch.logsumexp(s, dim=-1)
        p = self._probs(s, lse)
        out = torch.matmul(p, v.to(s.dtype).repeat_interleave(group, dim=1))
        return out.to(q.dtype), lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        s, group = self._scores(q, k, causal, _dense(q, k, allowed, segments), scale)
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
        bs, hc_kv = k.shape[:2]
        gk = gk.unflatten(1, (hc_kv, group)).sum(2)
        gv = gv.unflatten(1, (hc_kv, group)).sum(2)
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


_CPU, _MATH, _EFFICIENT = CpuFlashKernel(), MathKernel(), CudaEfficientKernel()
_LOGGED: set[tuple[str, str, str]] = set()


@cache
def _flash() -> tuple[FlashAttnKernel | None, VarlenKernel | None]:
    dense, varlen, found = detect_flash_attn()
    logger.info("ring attention: flash-attn probe: %s", found)
    return dense, varlen


def choose_kernel(
    device_type: str, dtype: torch.dtype, *, masked: bool, varlen: bool = False, same_head_size: bool = True
) -> BlockKernel:
    """The kernel for one block; `masked` blocks need a mask, `varlen` ones are planned as `Segments`.

    CPU: the flash kernel (any float dtype). CUDA fp16/bf16 with equal head sizes: flash-attn for dense
    blocks, a varlen flash kernel (flash-attn's, else torch's) for packed ones; torch's efficient
    kernel for the other masked blocks and fp32; float64 and other devices: the math kernel. Logs
    each (device, dtype, block kind) choice once per process.
    """
    if device_type == "cpu":
        kernel: BlockKernel = _CPU
    elif device_type == "cuda" and dtype != torch.float64:
        kernel = _EFFICIENT
        if dtype in (torch.float16, torch.bfloat16) and same_head_size and (varlen or not masked):
            flash_dense, flash_varlen = _flash()
            if not masked and flash_dense is not None:
                kernel = flash_dense
            elif varlen:
                kernel = flash_varlen or TORCH_VARLEN
    else:
        kernel = _MATH
    kind = "packed" if varlen else "masked" if masked else "dense"
    kind += "" if same_head_size else " (unequal head sizes)"
    key = (device_type, str(dtype), kind)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("ring attention: %s %s %s blocks use the %s kernel", device_type, dtype, kind, kernel.name)
    return kernel


def select_kernel(q: torch.Tensor, plan: BlockPlan, same_head_size: bool = True) -> BlockKernel:
    """The kernel for `plan`'s block of `q` (its device and dtype decide, see `choose_kernel`)."""
    return choose_kernel(
        q.device.type, q.dtype, masked=plan.masked, varlen=plan.segments is not None, same_head_size=same_head_size
    )

"""torch's memory-efficient CUDA kernel: blocks with a mask (sliding windows, chunks, packed blocks in fp32), every
fp32 block, and head sizes flash does not take.

`EfficientKernel` is the one adapter for `aten._scaled_dot_product_efficient_attention` and its backward. Contract
(aten/src/ATen/native/transformers/cuda/mem_eff_attention/kernel_forward.h and kernel_backward.h `check_supported`,
attention_backward.cu):

- q, k, v `[B, H, M, K]`, read as `[B, M, H, K]` through a transpose: pointers and strides along M, H and B aligned
  to 128 bits, 8 elements in fp16/bf16 and 4 in fp32 (on sm80+ the half-precision kernels are all `kAligned`, their
  `kAlignmentQ` is 128 / 16 bits; `check_supported`); so the head sizes must be multiples of that
  (`efficient_supports`: others run on the math kernel). One head count for q, k and v (no GQA: kv heads are
  expanded here and their gradients summed back over each group).
- bias: q's dtype, `[B, H, M, N]` with B and H equal to the query's (attention.cu "attn_bias: wrong shape (batch
  dimension)": no broadcast over the batch, unlike SDPA's front end), last dimension contiguous, strides aligned as
  above; a stride-0 broadcast passes. `aligned_bias` pads rows to 16 elements (as SDPA's own `pad_bias`) and
  broadcasts batch and heads.
- LSE: the forward returns float32 `[B, H, ceil(M / 32) * 32]` and fills the padding with +inf ("To make the
  backward easier, we pad logsumexp with inf"). The backward reads it through its strides up to that padded length
  and refuses a head or batch stride that is not a multiple of 8 ("LSE is not correctly aligned (strideH)"); the
  merged LSE is handed over in that same padded layout (`padded_lse`).
- out: the fp16/bf16 backward computes rowsum(dO * O) itself and reads `out` with a row stride of `head_dim_value *
  num_heads` (`o_strideM()`), whatever its real strides: only `[B, M, H, K]`-dense memory is read right
  (`bmhk_out`). An `out` contiguous as `[B, H, M, K]` is read from the wrong rows and past its end: the silently
  wrong and NaN ring gradients measured on an H200 (2026-12-04).
- a fully masked row gets LSE 0 and out 0 (kernel_forward.h); `clear_empty_rows` makes them -inf and 0. In the
  backward a row whose merged LSE is -inf (no key in any block) would give exp(-inf - (-inf)) = NaN: it is handed
  over as +inf (`contract.backward_lse`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hf_longctx.attention.lse.contract import backward_lse, clear_empty_rows, no_segments

BIAS_ALIGNMENT = 16  # elements per bias row, as SDPA pads them
LSE_ALIGNMENT = 32  # kAlignLSE: the forward's LSE length is a multiple of it
ALIGN_BYTES = 16  # 128 bits: the alignment of pointers and strides the sm80+ kernels read (see the contract)


def min_alignment(dtype: torch.dtype) -> int:
    """Elements per 128 bits: 8 in fp16/bf16, 4 in fp32."""
    return ALIGN_BYTES // dtype.itemsize


def efficient_supports(dtype: torch.dtype, head_dim: int, head_dim_v: int) -> bool:
    """Whether the kernel's stride checks can hold for contiguous `dtype` inputs of these head sizes."""
    return head_dim % min_alignment(dtype) == 0 and head_dim_v % min_alignment(dtype) == 0


def aligned_bias(allowed: torch.Tensor, dtype: torch.dtype, batch: int, heads: int) -> torch.Tensor:
    """Additive 0 / -inf bias `[batch, heads, nr, nc]` from a boolean `[1 or batch, 1, nr, nc]` mask: rows padded to
    an aligned stride and sliced back, batch and heads broadcast with stride 0 (never copied)."""
    nc = allowed.shape[-1]
    padded = -(-nc // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    bias = torch.full((*allowed.shape[:-1], padded), float("-inf"), dtype=dtype, device=allowed.device)
    bias[..., :nc].masked_fill_(allowed, 0.0)
    return bias[..., :nc].expand(batch, heads, -1, -1)


def padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """`lse` `[B, H, M]` in the forward's layout: a fresh float32 `[B, H, ceil(M / 32) * 32]` buffer, +inf padded;
    a row that saw no key anywhere (-inf) as +inf too (`contract.backward_lse`: zero gradients, not NaN)."""
    m = lse.shape[-1]
    size = (*lse.shape[:-1], -(-m // LSE_ALIGNMENT) * LSE_ALIGNMENT)
    out = torch.full(size, math.inf, dtype=torch.float32, device=lse.device)
    out[..., :m] = backward_lse(lse)
    return out


def _aligned(t: torch.Tensor) -> bool:
    # The fp16/bf16 backward loads `out` 128 bits at a time (kernel_backward.h computeDelta) though check_supported
    # only asks for kMinimumAlignment: 16 bytes keeps those loads aligned.
    return t.data_ptr() % ALIGN_BYTES == 0


def bmhk_out(out: torch.Tensor) -> torch.Tensor:
    """`out` `[B, H, M, K]` whose memory is `[B, M, H, K]`-dense (row stride H * K), as the backward reads it."""
    t = out.transpose(1, 2)  # [B, M, H, K]
    if t.stride(3) == 1 and t.stride(2) == t.shape[3] and t.stride(1) == t.shape[2] * t.shape[3] and _aligned(t):
        return out
    return t.contiguous().transpose(1, 2)


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _sum_groups(g: torch.Tensor, hc_kv: int) -> torch.Tensor:
    return g.unflatten(1, (hc_kv, g.shape[1] // hc_kv)).sum(2)


class EfficientKernel:
    """torch's memory-efficient kernel on a block (see the module contract). `ops` is `torch.ops.aten` (a stand-in
    enforcing the same contract in the CPU tests)."""

    name = "cuda_efficient"

    def __init__(self, ops: Any = None) -> None:
        self._ops = ops if ops is not None else torch.ops.aten

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        no_segments(segments)
        bias = None if allowed is None else aligned_bias(allowed, q.dtype, *q.shape[:2])
        out, lse, _, _ = self._ops._scaled_dot_product_efficient_attention(
            q.contiguous(), _expand_kv(q, k).contiguous(), _expand_kv(q, v).contiguous(), bias, True, 0.0, causal,
            scale=scale,
        )  # fmt: skip
        return clear_empty_rows(out, lse[..., : q.shape[2]].float().contiguous(), allowed)

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        no_segments(segments)
        bias = None if allowed is None else aligned_bias(allowed, q.dtype, *q.shape[:2])
        seed = offset = torch.zeros((), dtype=torch.int64)  # read only with dropout (a CPU scalar, as torch's own)
        gq, gk, gv, _ = self._ops._scaled_dot_product_efficient_attention_backward(
            dout, q.contiguous(), _expand_kv(q, k).contiguous(), _expand_kv(q, v).contiguous(), bias, bmhk_out(out),
            padded_lse(lse.float()), seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return gq, _sum_groups(gk, k.shape[1]), _sum_groups(gv, v.shape[1])

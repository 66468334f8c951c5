"""The layout every block kernel takes and returns (`BlockKernel`).

q `[bs, hc, sq, hs]`, k/v `[bs, hc_kv, sk, hs(_v)]` (GQA: `hc % hc_kv == 0`, query head h reads kv head
`h // (hc / hc_kv)`), in any strides; out `[bs, hc, sq, hs_v]` in q's dtype and LSE `[bs, hc, sq]` contiguous,
natural log, in `lse_dtype(q.dtype)`. `allowed` is an optional boolean `[bs or 1, 1, sq, sk]` mask and `segments`
the varlen form of a packed block (`segments.Segments`; mask kernels turn it into a mask); `causal` is only ever
asked of square blocks, so top-left vs bottom-right alignment never matters. A row without any visible key comes
back with out 0 and LSE -inf from every kernel (`clear_empty_rows`), so the merge adds nothing for it. The
backward takes the *global* out and LSE (the merged ones), which makes each block's gradients exact partial sums.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hf_longctx.attention.lse.segments import Segments

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


def dense_mask(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, segments: Segments | None):
    """The boolean mask a mask kernel applies: `allowed`, or the one the varlen segments stand for."""
    if allowed is None and segments is not None:
        return segments.mask(q.shape[0], q.shape[2], k.shape[2])
    return allowed


def clear_empty_rows(
    out: torch.Tensor, lse: torch.Tensor, allowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """out 0 and LSE -inf on the rows `allowed` gives no key (mask kernels report LSE 0 there: torch's CPU flash
    kernel and the memory-efficient kernel, kernel_forward.h "We set fully masked out rows to 0")."""
    if allowed is None:
        return out, lse
    empty = ~allowed.any(-1)  # [bs or 1, 1, sq]
    if not bool(empty.any()):
        return out, lse
    return out.masked_fill(empty.unsqueeze(-1), 0.0), lse.masked_fill(empty, float("-inf"))

"""The layout every block kernel takes and returns (`BlockKernel`).

q `[bs, hc, sq, hs]`, k/v `[bs, hc_kv, sk, hs(_v)]` (GQA: `hc % hc_kv == 0`, query head h reads kv head
`h // (hc / hc_kv)`), in any strides; out `[bs, hc, sq, hs_v]` in q's dtype and LSE `[bs, hc, sq]` contiguous,
natural log, in `lse_dtype(q.dtype)`. `allowed` is an optional boolean `[bs or 1, 1, sq, sk]` mask and `segments`
the varlen form of a packed block (`segments.Segments`; mask kernels turn it into a mask); `causal` is only ever
asked of square blocks, so top-left vs bottom-right alignment never matters. A row without any visible key comes
back with out 0 and LSE -inf from every kernel (`clear_empty_rows`), so the merge adds nothing for it. The
backward takes the *global* out and LSE (the merged ones), which makes each block's gradients exact partial sums;
the mask kernels (the only ones a row without keys can reach) read a row whose global LSE is -inf, one that saw no
key anywhere, as +inf (`backward_lse`), which gives it zero gradients instead of NaN.
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


def no_segments(segments: Segments | None) -> None:
    """Refuse a packed block on a kernel that would have to build its dense mask (`loop.segment_loop` runs one)."""
    if segments is not None:
        raise ValueError("A packed block reached a mask kernel: run it segment by segment (lse.loop.segment_loop).")


def dense_mask(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, segments: Segments | None):
    """The boolean mask the math kernel applies: `allowed`, or the one the varlen segments stand for."""
    if allowed is None and segments is not None:
        return segments.mask(q.shape[0], q.shape[2], k.shape[2])
    return allowed


def backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """The merged LSE as a mask kernel's backward takes it: -inf (a row that saw no key in any block) as +inf.

    The backward recomputes P = exp(s - LSE) with s = -inf on masked pairs: -inf - (-inf) is NaN (measured on
    torch's CPU flash backward; the memory-efficient kernel computes the same `exp(s - lse)`, kernel_backward.h),
    which spreads into that row's dq and every dk/dv it touches. With +inf every P of the row is 0 and so are its
    gradients (the efficient kernel pads its LSE with +inf for the same reason). No plan produces such a row
    today (every query sees itself); a future mask could."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


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

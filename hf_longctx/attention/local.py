"""sdpa and eager over the full sequence of a rank's heads: per segment, in the blocks of `blocks.plan_segment`.

`attend_blocks` is the main entry (`kernels.attend` calls it). Each row's q/k/v are split at its segment
boundaries (documents, and chunks for chunked-attention layers) into views whose gradients come back as one
concatenation, so no segment ever sees another's keys and no `[S, S]` mask exists. A segment longer than the
layer's sliding window runs as a band (see `blocks.py`); its inner blocks, which share one shape and one mask, go
to the kernel as one batched call: queries as a view `[n, h, rows, d]`, keys and values as an `unfold` of the
segment (`[n, h_kv, rows + W - 1, d]`, a copy at most twice their size). torch's SDPA takes no window argument and
transformers' sdpa / eager kernels return no log-sum-exp to merge partial blocks with, so the band is built here
from whole-row calls of the model's own kernel (which keeps its sinks, soft-capping and dropout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.attention.blocks import AttentionBlock, plan_segment

Kernel = Callable[..., tuple[torch.Tensor, Any]]


def block_allowed(block: AttentionBlock, window: int | None, device: torch.device | None = None) -> torch.Tensor:
    """Boolean `[rows, keys]` mask of a masked block: `j <= i` and, with a window, `i - j < window`."""
    qi = torch.arange(block.q0, block.q1, device=device).unsqueeze(1)
    kj = torch.arange(block.k0, block.q1, device=device).unsqueeze(0)
    ok = kj <= qi
    return ok & (qi - kj < window) if window is not None else ok


def _kernel_mask(block: AttentionBlock, window: int | None, family: str, like: torch.Tensor) -> torch.Tensor | None:
    """The mask the kernel takes: boolean for sdpa, additive (0 / dtype minimum) for eager, `[1, 1, rows, keys]`."""
    if not block.masked:
        return None
    allowed = block_allowed(block, window, like.device)[None, None]
    if family != "eager":
        return allowed
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(
        ~allowed, torch.finfo(like.dtype).min
    )


def _block_inputs(block: AttentionBlock, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One segment's `[1, h, L, d]` q/k/v -> the block's, its repeats stacked on the batch dimension."""
    if block.repeat == 1:
        keys = slice(block.k0, block.q1)
        return q[:, :, block.q0 : block.q1], k[:, :, keys], v[:, :, keys]
    rows, end = block.rows, block.q1 + (block.repeat - 1) * block.rows
    # [1, h, n * rows, d] -> [n, h, rows, d]: a view
    qb = q[:, :, block.q0 : end].unflatten(2, (block.repeat, rows)).transpose(1, 2).flatten(0, 1)
    # [1, h, n * rows + W - 1, d] -> windows of `keys` every `rows` tokens [1, h, n, d, keys] -> [n, h, keys, d]
    kb, vb = (t[:, :, block.k0 : end].unfold(2, block.keys, rows).permute(0, 2, 1, 4, 3).flatten(0, 1) for t in (k, v))
    return qb, kb, vb


def _segment(
    kernel: Kernel,
    module: Any,
    family: str,
    qkv: tuple[torch.Tensor, ...],
    kwargs: dict[str, Any],
    window: int | None,
) -> list[torch.Tensor]:
    """The `[1, n, hc_l, hs_v]` outputs of one segment's blocks, queries in order."""
    q = qkv[0]
    outs = []
    for block in plan_segment(q.shape[2], window, family == "eager"):
        qb, kb, vb = _block_inputs(block, *qkv)
        out = kernel(module, qb, kb, vb, _kernel_mask(block, window, family, q), **kwargs)[0]  # [n, rows, hc_l, hs_v]
        outs.append(out.reshape(1, -1, *out.shape[2:]))
    return outs


def attend_blocks(
    kernel: Kernel,
    module: Any,
    family: str,
    segments: list[list[tuple[int, int]]],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
    window: int | None,
) -> torch.Tensor:
    """Run an sdpa or eager `kernel` segment by segment (see the module docstring).

    Args:
        kernel: the model's attention function (transformers' signature); module: what it reads as its module.
        family: "sdpa" or "eager".
        segments: per row, the `[start, end)` ranges that attend only among themselves (`SequenceContext.segments`).
        query: `[bs, hc_l, sl, hs]`; key / value: `[bs, hc_kv_l, sl, hs(_v)]`.
        kwargs: the keyword arguments for the kernel; window: the layer's sliding window, or None.

    Returns:
        `[bs, sl, hc_l, hs_v]`, the kernel's output layout.
    """
    rows = []
    for b, row in enumerate(segments):
        lengths = [end - start for start, end in row]
        # Views of this row's segments: their gradients reach q/k/v through one concatenation.
        parts = zip(*(t[b : b + 1].split(lengths, dim=2) for t in (query, key, value)), strict=True)
        outs = [out for qkv in parts for out in _segment(kernel, module, family, qkv, kwargs, window)]
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0)

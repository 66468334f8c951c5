"""Ring blocks under a sliding window, planned as small tiles from per-row key ranges, never from a dense mask.

`plan_band` is the main function (`plan.plan_block` calls it for windowed layers). Under a window, with packed
documents or chunks or neither, every query row of a block sees one contiguous range of the block's keys (its
segment's keys, up to its own position, at most `window - 1` before it), and those ranges only move forward from
one row to the next within a run of consecutive positions of one segment. So the rows are cut into tiles of at
most `band_rows(window)` rows inside such runs, and each tile becomes one kernel call on the columns its rows see:
at most `rows + window - 1` of them, with a `[rows, columns]` mask only where the tile is neither fully visible nor
square causal. Rows that see no key of the block are left out, and a block that no row sees is skipped: work and
memory follow the visible pairs (O(S x W)), as transformers' `[S, S]` window mask per block pair did not. The
ring's online-softmax merge joins the tiles of a row like the blocks of other ranks. Flash's window arguments
would serve only the square blocks of one run (zigzag runs jump, and cross-rank blocks need a window aligned
elsewhere than bottom-right), so every kernel gets the same tiles.
"""

from __future__ import annotations

import torch

from hf_longctx.attention.blocks import band_rows
from hf_longctx.attention.ring.block import BlockPlan


def key_ranges(
    q_index: torch.Tensor, k_index: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(lo, hi)` per query row: it sees exactly the keys `[lo, hi)` (empty when `lo >= hi`).

    Args:
        q_index, k_index: increasing global positions of the queries and keys.
        q_seg, k_seg: their segment ids (documents, cut at chunks), non-decreasing.
        window: query i sees key j only if `i - j < window`.
    """
    lo = torch.searchsorted(k_seg, q_seg, right=False)
    lo = torch.maximum(lo, torch.searchsorted(k_index, q_index - window, right=True))
    hi = torch.searchsorted(k_seg, q_seg, right=True)
    hi = torch.minimum(hi, torch.searchsorted(k_index, q_index, right=True))
    return lo, hi


def tile_starts(q_index: torch.Tensor, q_seg: torch.Tensor, rows: int) -> list[int]:
    """First row of every tile: where a segment or a run of consecutive positions starts, and every `rows` rows
    within one."""
    n = q_index.numel()
    new_run = torch.ones(n, dtype=torch.bool, device=q_index.device)
    new_run[1:] = (q_seg[1:] != q_seg[:-1]) | (q_index[1:] != q_index[:-1] + 1)
    run_first = torch.cummax(torch.where(new_run, torch.arange(n, device=q_index.device), 0), dim=0).values
    offset = torch.arange(n, device=q_index.device) - run_first
    return torch.nonzero(offset % rows == 0).flatten().tolist()


def _tile(q_index, k_index, lo, hi, r0: int, r1: int, batch: slice | None) -> BlockPlan | None:
    """The kernel call of rows `[r0, r1)`: cropped to the rows that see a key, on the columns they see."""
    seen = torch.nonzero(lo[r0:r1] < hi[r0:r1]).flatten()
    if seen.numel() == 0:
        return None
    r0, r1 = r0 + int(seen[0]), r0 + int(seen[-1]) + 1
    c0, c1 = int(lo[r0]), int(hi[r1 - 1])  # both non-decreasing over the tile's rows
    cols = torch.arange(c0, c1, device=lo.device)
    allowed = (cols[None, :] >= lo[r0:r1, None]) & (cols[None, :] < hi[r0:r1, None])  # [rows, cols]
    rows_, cols_ = slice(r0, r1), slice(c0, c1)
    if bool(allowed.all()):
        return BlockPlan(rows_, cols_, causal=False, batch=batch)
    square = r1 - r0 == c1 - c0 and torch.equal(q_index[rows_], k_index[cols_])
    if square and torch.equal(allowed, torch.ones_like(allowed).tril()):
        return BlockPlan(rows_, cols_, causal=True, batch=batch)
    return BlockPlan(rows_, cols_, causal=False, allowed=allowed[None, None], batch=batch)


def plan_band(
    q_index: torch.Tensor, k_index: torch.Tensor, segment_ids: torch.Tensor | None, window: int, rows: int | None
) -> tuple[BlockPlan, ...]:
    """The tiles of queries at `q_index` against keys at `k_index` under `window` (empty: skip the block).

    Args:
        segment_ids: `[bs, sl]` non-decreasing segment id per token and row, or None (one segment per row).
        rows: rows per tile (default `band_rows(window)`).

    Returns:
        One plan per tile that sees a key; rows whose segments differ get per-row plans (`BlockPlan.batch`).
    """
    rows = rows or band_rows(window)
    if segment_ids is None or bool((segment_ids == segment_ids[:1]).all()):
        batches = [(None, segment_ids[0] if segment_ids is not None else None)]
    else:
        batches = [(slice(b, b + 1), segment_ids[b]) for b in range(segment_ids.shape[0])]
    plans = []
    for batch, seg in batches:
        q_seg = seg[q_index] if seg is not None else torch.zeros_like(q_index)
        k_seg = seg[k_index] if seg is not None else torch.zeros_like(k_index)
        lo, hi = key_ranges(q_index, k_index, q_seg, k_seg, window)
        if not bool((lo < hi).any()):
            continue
        starts = tile_starts(q_index, q_seg, rows) + [q_index.numel()]
        for r0, r1 in zip(starts[:-1], starts[1:], strict=True):
            plan = _tile(q_index, k_index, lo, hi, r0, r1, batch)
            if plan is not None:
                plans.append(plan)
    return tuple(plans)

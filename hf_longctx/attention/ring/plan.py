"""The pure half of ring attention: which query rows meet which keys, and the online-softmax merge.

A ring rank holds the tokens at global positions `q_index` (increasing); at some step it holds the
keys of another ring rank, at positions `k_index`. Query i may see key j when j <= i, both belong to
the same packed document, and (optionally) j is inside i's sliding window and the same position
chunk (chunked attention). `plan_block` turns that rule into the smallest kernel call: nothing
(skip), a crop of rows and columns that is fully visible, a square causal crop (the kernel's causal
flag), or a crop plus a boolean mask. Crops make zigzag's balanced half-blocks fall out by themselves.
`merge_block` folds one block's (out, LSE) into the running fp32 result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class VisibilityRule:
    """Who may attend to whom, on global positions of one forward's (padded) batch.

    `doc_ids` `[bs, sl]` is None when every row is one document; `position_ids` are needed only
    for `chunk` (chunk membership follows positions, which restart per document)."""

    doc_ids: torch.Tensor | None
    window: int | None = None
    chunk: int | None = None
    position_ids: torch.Tensor | None = None

    @property
    def simple(self) -> bool:
        """Plain causal over one document per row: blocks are planned from index ranges alone."""
        return self.doc_ids is None and self.window is None and self.chunk is None

    def allowed(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Boolean `[bs or 1, nq, nk]`: query `q_index[i]` may see key `k_index[j]`."""
        ok = (k_index[None, :] <= q_index[:, None]).unsqueeze(0)
        if self.window is not None:
            ok = ok & ((q_index[:, None] - k_index[None, :]) < self.window).unsqueeze(0)
        if self.doc_ids is not None:
            doc = self.doc_ids
            ok = ok & (doc[:, q_index][:, :, None] == doc[:, k_index][:, None, :])
        if self.chunk is not None:
            block = self.position_ids // self.chunk
            ok = ok & (block[:, q_index][:, :, None] == block[:, k_index][:, None, :])
        return ok


@dataclass(frozen=True)
class BlockPlan:
    """One kernel call: queries `rows` of the local block against keys `cols` of the source block.

    `allowed` `[bs or 1, 1, nrows, ncols]` is set only when neither "all visible" nor "square causal"
    describes the crop; `empty_rows` `[bs, nrows]` marks rows of the crop that see no key (their
    LSE must become -inf before the merge), None when there are none."""

    rows: slice
    cols: slice
    causal: bool
    allowed: torch.Tensor | None = field(default=None, repr=False)
    empty_rows: torch.Tensor | None = field(default=None, repr=False)

    @property
    def pairs(self) -> int:
        """Query-key pairs the kernel computes (half of the square for a causal crop)."""
        n, m = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        return n * (n + 1) // 2 if self.causal else n * m


def _span(mask: torch.Tensor) -> slice:
    hits = torch.nonzero(mask).flatten()
    return slice(int(hits[0]), int(hits[-1]) + 1)


def plan_block(q_index: torch.Tensor, k_index: torch.Tensor, rule: VisibilityRule) -> BlockPlan | None:
    """Plan queries at `q_index` (increasing) against keys at `k_index` (increasing); None = skip."""
    if rule.simple:
        # Visible iff k <= q: a suffix of the queries meets a prefix of the keys, O(n) to plan.
        lo_k, hi_q = int(k_index[0]), int(q_index[-1])
        if lo_k > hi_q:
            return None
        rows = slice(int(torch.searchsorted(q_index, lo_k)), q_index.numel())
        cols = slice(0, int(torch.searchsorted(k_index, hi_q, right=True)))
        q, k = q_index[rows], k_index[cols]
        if int(k[-1]) <= int(q[0]):
            return BlockPlan(rows, cols, causal=False)
        if q.numel() == k.numel() and bool(torch.equal(q, k)):
            return BlockPlan(rows, cols, causal=True)
        return BlockPlan(rows, cols, causal=False, allowed=rule.allowed(q, k).unsqueeze(1))
    allowed = rule.allowed(q_index, k_index)
    if not bool(allowed.any()):
        return None
    rows, cols = _span(allowed.any(-1).any(0)), _span(allowed.any(1).any(0))
    crop = allowed[:, rows, cols]
    if bool(crop.all()):
        return BlockPlan(rows, cols, causal=False)
    q, k = q_index[rows], k_index[cols]
    if q.numel() == k.numel() and bool(torch.equal(q, k)):
        tril = torch.ones(q.numel(), q.numel(), dtype=torch.bool, device=crop.device).tril()
        if bool((crop == tril).all()):
            return BlockPlan(rows, cols, causal=True)
    empty = ~crop.any(-1)
    return BlockPlan(
        rows, cols, causal=False, allowed=crop.unsqueeze(1), empty_rows=empty if bool(empty.any()) else None
    )


def plan_ring(indices: list[torch.Tensor], rank: int, rule: VisibilityRule) -> tuple[BlockPlan | None, ...]:
    """Plans of ring rank `rank` against every ring rank's keys; `indices[i]` = ring rank i's positions."""
    return tuple(plan_block(indices[rank], indices[src], rule) for src in range(len(indices)))


def fix_empty_rows(lse: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """Set the LSE of rows that see no key in this block to -inf (the CPU kernel reports 0 there,
    which would silently down-weight every other block of that row in the merge)."""
    if plan.empty_rows is None:
        return lse
    return lse.masked_fill(plan.empty_rows[:, None, :], float("-inf"))


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, rows: slice):
    """Fold one block's result into the running `out` `[bs, hc, sq, hs]` / `lse` `[bs, hc, sq]` (in place).

    L = logaddexp(L_a, L_b), O = exp(L_a - L) O_a + exp(L_b - L) O_b. Rows where both sides are -inf
    (nothing seen yet, nothing in this block) keep O = 0 and L = -inf instead of NaN.
    """
    run_out, run_lse = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(run_lse, block_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    run_out.mul_(torch.exp(run_lse - safe).unsqueeze(-1))
    run_out.add_(block_out.to(out.dtype) * torch.exp(block_lse - safe).unsqueeze(-1))
    run_lse.copy_(new)

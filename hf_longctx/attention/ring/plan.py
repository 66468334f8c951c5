"""The pure half of ring attention: which query rows meet which keys, as kernel calls (`BlockPlan`s).

A ring rank holds the tokens at global positions `q_index` (increasing); at some step it holds the
keys of another ring rank, at positions `k_index`. Query i may see key j when j <= i, both belong to
the same packed document and the same chunk of positions (chunked attention), and (optionally) j is
inside i's sliding window. `plan_block` turns that rule into the fewest small kernel calls, never from a
dense `[block, block]` mask: plain causal blocks become a crop of rows and columns that is fully visible or
a square causal crop (the kernel's causal flag), which makes zigzag's balanced half-blocks fall out by
themselves; packed documents and chunks are planned from runs of segment ids in O(n), each block as varlen
`Segments` (one per batch row and run of a segment's queries that meets keys in the block), which CUDA runs
with a varlen flash kernel and the other kernels segment by segment (`lse/loop.py`); a sliding window as
tiles of rows against the keys they see (`band.py`). The blocks' (out, LSE) are merged by
`attention/lse/merge.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from hf_longctx.attention.lse.segments import Segments
from hf_longctx.attention.ring.band import plan_band
from hf_longctx.attention.ring.block import BlockPlan


@dataclass(frozen=True, eq=False)
class VisibilityRule:
    """Who may attend to whom, on global positions of one forward's (padded) batch.

    `doc_ids` `[bs, sl]` is None when every row is one document, else non-decreasing along each row
    (a cumulative count of document starts); `position_ids` are needed only for `chunk` (chunk
    membership follows positions, which restart per document). `tile_rows`: rows per windowed tile
    (default `blocks.band_rows(window)`)."""

    doc_ids: torch.Tensor | None
    window: int | None = None
    chunk: int | None = None
    position_ids: torch.Tensor | None = None
    tile_rows: int | None = None

    @property
    def simple(self) -> bool:
        """Plain causal over one document per row: blocks are planned from index ranges alone."""
        return self.doc_ids is None and self.window is None and self.chunk is None

    @cached_property
    def segment_ids(self) -> torch.Tensor | None:
        """`[bs, sl]` non-decreasing id of each token's segment (its document, cut at every multiple of `chunk`
        positions, as transformers' chunked masks), or None for one segment per row."""
        if self.chunk is None:
            return self.doc_ids
        starts = self.position_ids % self.chunk == 0
        starts[:, 0] = True
        if self.doc_ids is not None:
            starts[:, 1:] |= self.doc_ids[:, 1:] != self.doc_ids[:, :-1]
        return starts.long().cumsum(dim=1)

    def allowed(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """Boolean `[bs or 1, nq, nk]`: query `q_index[i]` may see key `k_index[j]`. Dense: for references, and
        for the crop of a plain causal block in a layout whose crops are neither full nor square."""
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


def plan_block(q_index: torch.Tensor, k_index: torch.Tensor, rule: VisibilityRule) -> tuple[BlockPlan, ...]:
    """Plan queries at `q_index` (increasing) against keys at `k_index` (increasing); no plan = skip.

    Raises:
        ValueError: segment ids that decrease along a row (they are cumulative counts of segment starts).
    """
    if rule.simple:
        plan = _plan_causal(q_index, k_index, rule)
        return () if plan is None else (plan,)
    segment_ids = rule.segment_ids
    if segment_ids is not None and bool((segment_ids[:, 1:] < segment_ids[:, :-1]).any()):
        raise ValueError("VisibilityRule: document / segment ids must be non-decreasing along every row.")
    if rule.window is not None:
        return plan_band(q_index, k_index, segment_ids, rule.window, rule.tile_rows)
    plan = _plan_documents(q_index, k_index, segment_ids)
    return () if plan is None else (plan,)


def _plan_causal(q_index: torch.Tensor, k_index: torch.Tensor, rule: VisibilityRule) -> BlockPlan | None:
    """Visible iff k <= q: a suffix of the queries meets a prefix of the keys, O(n) to plan."""
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


def _runs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(value, start, end) of each run of equal values in a 1-D tensor."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = counts.cumsum(0)
    return values, ends - counts, ends


def _spans(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of `arange(s, s + n)` over (starts, lengths)."""
    first = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - first, lengths) + torch.arange(int(lengths.sum()), device=starts.device)


def _document_pairs(q_index: torch.Tensor, k_index: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, diagonal: bool):
    """(q starts, q ends, k starts, k ends) of one batch row's segments: index ranges of the local queries and of
    the keys they see, every pair fully visible (or square causal on the diagonal block)."""
    kv, ks, ke = _runs(dk)
    if diagonal:  # one square causal segment per document run (local order follows global positions)
        qv, qs, qe = _runs(dq)
    else:
        # Split each document's queries where positions jump: another rank's keys never fall inside a run of
        # consecutive positions, so a run sees exactly its document's keys before its first position (a prefix of
        # that document's keys) and nothing after. Zigzag's two chunks per rank give two runs of a long document.
        jumps = torch.cat([q_index.new_zeros(1), (q_index[1:] != q_index[:-1] + 1).long().cumsum(0)])
        _, qs, qe = _runs(dq * (q_index.numel() + 1) + jumps)  # (document, run) pairs, non-decreasing
        qv = dq[qs]
    at = torch.searchsorted(kv, qv).clamp(max=kv.numel() - 1)
    hit = kv[at] == qv
    qs, qe, ks, ke = qs[hit], qe[hit], ks[at[hit]], ke[at[hit]]
    if not diagonal:
        ke = torch.minimum(ke, torch.searchsorted(k_index, q_index[qs]))  # keys before the run's first query
        seen = ke > ks
        qs, qe, ks, ke = qs[seen], qe[seen], ks[seen], ke[seen]
    return qs, qe, ks, ke


def _plan_documents(q_index: torch.Tensor, k_index: torch.Tensor, doc: torch.Tensor) -> BlockPlan | None:
    """Plan packed documents (or chunks) from runs of non-decreasing segment ids: a `BlockPlan` or None (skip).

    Exact for any two ring blocks: the diagonal block (the same positions) or disjoint position sets."""
    diagonal = q_index.numel() == k_index.numel() and bool(torch.equal(q_index, k_index))
    pairs = []  # per batch row: (q starts, q ends, k starts, k ends) of the segments
    for b in range(doc.shape[0]):
        dq, dk = doc[b, q_index], doc[b, k_index]
        pairs.append(_document_pairs(q_index, k_index, dq, dk, diagonal))
    if not any(p[0].numel() for p in pairs):
        return None
    r0, r1 = min(int(p[0].min()) for p in pairs if p[0].numel()), max(int(p[1].max()) for p in pairs if p[1].numel())
    c0, c1 = min(int(p[2].min()) for p in pairs if p[2].numel()), max(int(p[3].max()) for p in pairs if p[3].numel())
    nr, nc = r1 - r0, c1 - c0
    q_starts = torch.cat([qs - r0 + b * nr for b, (qs, _, _, _) in enumerate(pairs)])
    k_starts = torch.cat([ks - c0 + b * nc for b, (_, _, ks, _) in enumerate(pairs)])
    q_len = torch.cat([qe - qs for qs, qe, _, _ in pairs])
    k_len = torch.cat([ke - ks for _, _, ks, ke in pairs])
    rows, cols = slice(r0, r1), slice(c0, c1)
    if q_len.numel() == doc.shape[0] and bool((q_len == nr).all()) and bool((k_len == nc).all()):
        return BlockPlan(rows, cols, causal=diagonal)  # one document over the whole crop in every row
    zero = torch.zeros(1, dtype=torch.int32, device=q_index.device)
    segments = Segments(
        q_tokens=_spans(q_starts, q_len),
        k_tokens=_spans(k_starts, k_len),
        cu_q=torch.cat([zero, q_len.cumsum(0).int()]),
        cu_k=torch.cat([zero, k_len.cumsum(0).int()]),
        max_q=int(q_len.max()),
        max_k=int(k_len.max()),
        causal=diagonal,
    )
    return BlockPlan(rows, cols, causal=False, segments=segments)


def plan_ring(indices: list[torch.Tensor], rank: int, rule: VisibilityRule) -> tuple[tuple[BlockPlan, ...], ...]:
    """Plans of ring rank `rank` against every ring rank's keys (`()`: skip); `indices[i]` = ring rank i's
    positions."""
    return tuple(plan_block(indices[rank], indices[src], rule) for src in range(len(indices)))

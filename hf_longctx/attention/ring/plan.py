"""The pure half of ring attention: which query rows meet which keys.

A ring rank holds the tokens at global positions `q_index` (increasing); at some step it holds the
keys of another ring rank, at positions `k_index`. Query i may see key j when j <= i, both belong to
the same packed document, and (optionally) j is inside i's sliding window and the same position
chunk (chunked attention). `plan_block` turns that rule into the smallest kernel call: nothing
(skip), a crop of rows and columns that is fully visible, a square causal crop (the kernel's causal
flag), or a crop plus a boolean mask. Crops make zigzag's balanced half-blocks fall out by themselves.
Packed documents alone (no window, no chunk) are planned from document runs in O(n), never from a
dense mask: each block becomes varlen `Segments` (one per batch row and run of a document's queries that meets
keys in the block), which CUDA runs with a varlen flash kernel and the CPU kernels turn into a mask. The blocks'
(out, LSE) are merged by `attention/lse/merge.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_longctx.attention.lse.segments import Segments


@dataclass(frozen=True)
class VisibilityRule:
    """Who may attend to whom, on global positions of one forward's (padded) batch.

    `doc_ids` `[bs, sl]` is None when every row is one document, else non-decreasing along each row
    (a cumulative count of document starts); `position_ids` are needed only for `chunk` (chunk
    membership follows positions, which restart per document)."""

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
    describes the crop, and `segments` instead of it for packed documents. Rows of the crop that see no key come
    back from every kernel with out 0 and LSE -inf (`attention/lse/contract.py`)."""

    rows: slice
    cols: slice
    causal: bool
    allowed: torch.Tensor | None = field(default=None, repr=False)
    segments: Segments | None = field(default=None, repr=False)

    @property
    def masked(self) -> bool:
        """Whether the kernel needs more than the causal flag (a mask or varlen segments)."""
        return self.allowed is not None or self.segments is not None

    def mask(self, bs: int) -> torch.Tensor | None:
        """The dense boolean mask of a masked block (built from the segments when planned as such)."""
        if self.segments is None:
            return self.allowed
        n, m = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        return self.segments.mask(bs, n, m)

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
    if rule.window is None and rule.chunk is None:
        planned = _plan_documents(q_index, k_index, rule.doc_ids)
        if planned is not _PARTIAL:
            return planned
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
    return BlockPlan(rows, cols, causal=False, allowed=crop.unsqueeze(1))


_PARTIAL = object()  # document ids that are not a cumulative count: the dense rule decides


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


def _plan_documents(q_index: torch.Tensor, k_index: torch.Tensor, doc: torch.Tensor):
    """Plan packed documents from runs of document ids: a `BlockPlan`, None (skip) or `_PARTIAL`.

    Exact for any two ring blocks: the diagonal block (the same positions) or disjoint position sets."""
    diagonal = q_index.numel() == k_index.numel() and bool(torch.equal(q_index, k_index))
    pairs = []  # per batch row: (q starts, q ends, k starts, k ends) of the segments
    for b in range(doc.shape[0]):
        dq, dk = doc[b, q_index], doc[b, k_index]
        if bool((dq[1:] < dq[:-1]).any()) or bool((dk[1:] < dk[:-1]).any()):
            return _PARTIAL
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


def plan_ring(indices: list[torch.Tensor], rank: int, rule: VisibilityRule) -> tuple[BlockPlan | None, ...]:
    """Plans of ring rank `rank` against every ring rank's keys; `indices[i]` = ring rank i's positions."""
    return tuple(plan_block(indices[rank], indices[src], rule) for src in range(len(indices)))

"""How sdpa / eager attention of one segment is cut into kernel calls, torch-free so the planner can count them.

`plan_segment(length, window, always_mask)` is the main function; `attention/local.py` runs its blocks and
`planner.terms` counts the scores and masks they hold. A segment (a document, or a chunk of one) attends causally
among itself. Without a sliding window that is one causal call (eager, which has no causal flag: blocks of
queries, each with a `[q_block, keys]` mask). With a window W shorter than the segment it is a band: blocks of
`band_rows(W)` queries, each against the `rows + W - 1` keys ending at its last query, so masks and scores are
O(rows x (rows + W)) per block and O(S x W) in all, and every key outside a query's window is skipped rather than
masked. The band's inner blocks share one shape and one mask (the rule depends only on i - j), so they run as one
batched call (`AttentionBlock.repeat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# Largest `[q_block, keys]` mask (elements) a masked eager block of a segment without a window may take: eager's
# scores are this times the local heads, so memory stays bounded however long the document is.
MASK_BLOCK_ELEMENTS = 2**22
MIN_Q_BLOCK = 64


@dataclass(frozen=True)
class AttentionBlock:
    """Queries `[q0, q1)` of a segment (offsets from its start) attend keys `[k0, q1)`, and so do `repeat - 1`
    more blocks, each `q1 - q0` tokens after the previous one.

    `masked=False`: plain causal (`k0 == q0`, the kernel's causal flag). `masked=True`: query i may attend key j
    when `j <= i` and, with a window, `i - j < window`; that mask depends only on `i - j`, so one mask of
    `[rows, keys]` serves every repeat.
    """

    q0: int
    q1: int
    k0: int
    masked: bool
    repeat: int = 1

    @property
    def rows(self) -> int:
        return self.q1 - self.q0

    @property
    def keys(self) -> int:
        return self.q1 - self.k0

    @property
    def scores(self) -> int:
        """Query-key pairs the kernel computes for all repeats (eager holds this many scores per head)."""
        return self.repeat * self.rows * self.keys


def band_rows(window: int, min_rows: int = MIN_Q_BLOCK) -> int:
    """Queries per band block: the window (at least `min_rows`), so a block computes at most twice the pairs its
    queries see, and copies its keys and values at most twice."""
    return max(window, min_rows)


@lru_cache(maxsize=256)
def plan_segment(
    length: int,
    window: int | None,
    always_mask: bool,
    max_elements: int = MASK_BLOCK_ELEMENTS,
    min_rows: int = MIN_Q_BLOCK,
) -> tuple[AttentionBlock, ...]:
    """The kernel calls covering one segment of `length` tokens, queries in order.

    Args:
        length: the segment's tokens.
        window: the sliding window (query i sees key j only if `i - j < window`), or None.
        always_mask: the kernel has no causal flag (eager): every block carries its mask.
        max_elements: the largest `[q_block, keys]` mask of a segment without a binding window.
        min_rows: the fewest queries of a block (band blocks: `band_rows(window, min_rows)`).
    """
    if window is not None and length > window:
        return _band(length, window, band_rows(window, min_rows), always_mask)
    if not always_mask:
        return (AttentionBlock(0, length, 0, masked=False),)
    q_block = min(length, max(min_rows, max_elements // length))
    return tuple(AttentionBlock(q0, min(q0 + q_block, length), 0, masked=True) for q0 in range(0, length, q_block))


def _band(length: int, window: int, rows: int, always_mask: bool) -> tuple[AttentionBlock, ...]:
    """The first block (keys from the segment's start), the inner blocks as one repeated block, the rest."""
    first = min(rows, length)
    # The first block's window binds only if it holds more queries than the window.
    blocks = [AttentionBlock(0, first, 0, masked=always_mask or first > window)]
    inner, rest = divmod(length - first, rows)
    if inner:
        blocks.append(AttentionBlock(first, first + rows, first - window + 1, masked=True, repeat=inner))
    if rest:
        blocks.append(AttentionBlock(length - rest, length, length - rest - window + 1, masked=True))
    return tuple(blocks)

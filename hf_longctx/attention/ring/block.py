"""One kernel call of ring (and tile) attention: `BlockPlan`, what the planners (`plan.py`, `band.py`) produce."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hf_longctx.attention.lse.segments import Segments


@dataclass(frozen=True)
class BlockPlan:
    """One kernel call: queries `rows` of the local block against keys `cols` of the source block, in the batch
    rows `batch` (None: all of them).

    `allowed` `[bs or 1, 1, nrows, ncols]` is set only when neither "all visible" nor "square causal"
    describes the crop, and `segments` instead of it for packed documents. Rows of the crop that see no key come
    back from every kernel with out 0 and LSE -inf (`attention/lse/contract.py`)."""

    rows: slice
    cols: slice
    causal: bool
    allowed: torch.Tensor | None = field(default=None, repr=False)
    segments: Segments | None = field(default=None, repr=False)
    batch: slice | None = None

    @property
    def masked(self) -> bool:
        """Whether the kernel needs more than the causal flag (a mask or varlen segments)."""
        return self.allowed is not None or self.segments is not None

    @property
    def batch_rows(self) -> slice:
        """The batch rows this call covers, as an index (`slice(None)`: all)."""
        return self.batch if self.batch is not None else slice(None)

    def mask(self, bs: int) -> torch.Tensor | None:
        """The dense boolean mask of a masked block (built from the segments when planned as such); for tests and
        the math kernel, never on a long block."""
        if self.segments is None:
            return self.allowed
        n, m = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        return self.segments.mask(bs, n, m)

    @property
    def pairs(self) -> int:
        """Query-key pairs the kernel computes per batch row (half of the square for a causal crop)."""
        n, m = self.rows.stop - self.rows.start, self.cols.stop - self.cols.start
        return n * (n + 1) // 2 if self.causal else n * m

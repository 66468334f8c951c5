"""`ShardView`: where this rank's tokens sit in the whole batch, for one forward.

Built once per forward by the SP pre-hook from what it already holds (the all-gathered global positions, the
token layout, the unpadded row length the collator or `shard_batch` recorded), so the computations of this
package read whole-sequence facts without another collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_longctx.data.layout import layout_indices


@dataclass(frozen=True)
class ShardView:
    """One forward's view of the full batch from this rank."""

    positions: torch.Tensor  # [bs, sl] global position ids in sequence order, SP padding included
    local_index: torch.Tensor  # [sl_l] index in the row of each token this rank holds
    length: int  # tokens per row before SP padding: what a run without SP sees

    @classmethod
    def build(cls, positions: torch.Tensor, layout: str, sp_rank: int, sp_world_size: int, length: int | None):
        """The view of rank `sp_rank` on `positions` `[bs, sl]` (`length` None: no SP padding known)."""
        sl = positions.shape[1]
        index = layout_indices(layout, sp_rank, sp_world_size, sl).to(positions.device)
        return cls(positions, index, sl if length is None else min(int(length), sl))

    @property
    def padded(self) -> bool:
        """Whether the row carries SP padding after its `length` real tokens."""
        return self.length < self.positions.shape[1]

    def real_tokens(self) -> torch.Tensor:
        """`[sl_l]` True where this rank's token is a real token (not SP padding)."""
        return self.local_index < self.length

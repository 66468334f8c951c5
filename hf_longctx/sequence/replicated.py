"""A marker for scalars every SP rank holds whole (not as its shard's partial sum).

`gather_for_metrics` under SP sums 0-d and 1-d values over the SP group, because what TRL and users pass there
are per-rank partial sums (token counts, correct tokens). A value hf_longctx itself makes whole on every rank,
such as the MoE router loss it returns as `aux_loss`, carries this marker so that it is taken once instead.
"""

from __future__ import annotations

import torch

REPLICATED_ATTR = "_hf_longctx_replicated"


def mark_replicated(x: torch.Tensor) -> torch.Tensor:
    """Mark `x` as identical on every rank of its SP group; returns `x`."""
    setattr(x, REPLICATED_ATTR, True)
    return x


def is_replicated(x: object) -> bool:
    """Whether `x` was marked by `mark_replicated`."""
    return bool(getattr(x, REPLICATED_ATTR, False))

"""A marker for scalars every SP rank holds whole (not as its shard's partial sum).

`gather_for_metrics` under SP sums 0-d and 1-d values over the SP group, because what TRL and users pass there
are per-rank partial sums (token counts, correct tokens). A value hf_longctx itself makes whole on every rank,
such as the MoE router loss it returns as `aux_loss`, is marked so that it is taken once instead.

The mark is an attribute, and also the tensor's storage: DeepSpeed ZeRO-3 passes every output of a module
through an autograd function that returns `output.detach()` (a new tensor object without the attribute, on the
same storage). The last marked values are kept (detached: no autograd graph), so their storage cannot be freed
and reused by another tensor while it identifies them.
"""

from __future__ import annotations

from collections import deque

import torch

REPLICATED_ATTR = "_hf_longctx_replicated"
_RECENT: deque[torch.Tensor] = deque(maxlen=16)


def mark_replicated(x: torch.Tensor) -> torch.Tensor:
    """Mark `x` as identical on every rank of its SP group; returns `x`."""
    setattr(x, REPLICATED_ATTR, True)
    _RECENT.append(x.detach())
    return x


def is_replicated(x: object) -> bool:
    """Whether `x` is a tensor `mark_replicated` marked (or a detached alias of one)."""
    if getattr(x, REPLICATED_ATTR, False):
        return True
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return False
    ptr = x.untyped_storage().data_ptr()
    return any(t.device == x.device and t.untyped_storage().data_ptr() == ptr for t in _RECENT)

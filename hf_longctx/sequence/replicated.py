"""A marker for scalars every SP rank holds whole (not as its shard's partial sum).

`gather_for_metrics` under SP sums 0-d and 1-d values over the SP group, because what TRL and users pass there
are per-rank partial sums (token counts, correct tokens). A value hf_longctx itself makes whole on every rank,
such as the MoE router loss it returns as `aux_loss`, is marked so that it is taken once instead.

The mark is an attribute, the tensor's storage and its gradient node: DeepSpeed ZeRO-3 passes every output of a
module through an autograd function that returns `output.detach()` (a new tensor object without the attribute, on
the same storage), and DDP with `find_unused_parameters` returns clones whose gradient node leads back to the
marked tensor's. The last marked values are kept (detached: no autograd graph), so their storage cannot be freed
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
    if x.grad_fn is not None:
        x.grad_fn.metadata[REPLICATED_ATTR] = True  # seen through DDP's output clone (`_cloned_by_ddp`)
    return x


def _cloned_by_ddp(x: torch.Tensor) -> bool:
    """Whether `x` is DDP's clone of a marked tensor.

    With `find_unused_parameters=True` (the Trainer's default without activation checkpointing) DDP passes every
    output that has a gradient through its `_DDPSink` function, which returns clones: new tensors on new storage.
    The clone's gradient node leads back to the marked tensor's, whose metadata holds the mark.
    """
    node = x.grad_fn
    if node is None or type(node).__name__ != "_DDPSinkBackward":
        return False
    inputs = node.next_functions  # one per tensor it clones, in order (its module reference is not a tensor)
    source = inputs[x.output_nr][0] if x.output_nr < len(inputs) else None
    return source is not None and bool(source.metadata.get(REPLICATED_ATTR, False))


def is_replicated(x: object) -> bool:
    """Whether `x` is a tensor `mark_replicated` marked (or a detached alias or DDP's clone of one)."""
    if getattr(x, REPLICATED_ATTR, False):
        return True
    if not isinstance(x, torch.Tensor) or x.numel() == 0:
        return False
    ptr = x.untyped_storage().data_ptr()
    if any(t.device == x.device and t.untyped_storage().data_ptr() == ptr for t in _RECENT):
        return True
    return _cloned_by_ddp(x)

"""A `TorchDispatchMode` that fails on any tensor holding `limit` elements or more, and runs the fused attention
kernels as shape-only stand-ins.

Every op of a forward and backward goes through the mode, factory ops (a mask's `torch.ones`) included; a tensor's
size is its storage's (an `expand`ed view of a small tensor allocates nothing). torch's fused SDPA kernels never
hold a `[S, S]` tensor, so the mode returns zeros of their output shapes instead of computing them: what is checked
is what the code around them allocates (masks, eager scores, a math fallback), at lengths where computing
attention on two CPU cores would take minutes.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ATEN = torch.ops.aten
_FORWARD = _ATEN._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default


def _shapes_only(func, args):
    """Zeros shaped like the fused CPU flash kernel's outputs: (out, lse) forward, (dq, dk, dv) backward."""
    if func is _FORWARD:
        q, v = args[0], args[2]
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_zeros(*q.shape[:-1], v.shape[-1]), torch.zeros(q.shape[:-1], dtype=lse_dtype)
    return tuple(torch.zeros_like(t) for t in args[1:4])


class SquareTracker(TorchDispatchMode):
    """Raise `AssertionError` when an op's output holds `limit` elements or more; record the largest seen."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.largest, self.where = limit, 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _shapes_only(func, args) if func in (_FORWARD, _BACKWARD) else func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                n = t.untyped_storage().nbytes() // max(t.element_size(), 1)
                if n > self.largest:
                    self.largest, self.where = n, f"{func} -> {tuple(t.shape)} {t.dtype}"
                assert n < self.limit, (
                    f"{func} made a tensor of {n:,} elements (limit {self.limit:,}): {tuple(t.shape)}"
                )
        return out

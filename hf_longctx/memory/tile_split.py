"""`split_tiles(x, n, dim)`: `torch.tensor_split` whose backward writes every tile's gradient into one buffer.

Autograd's backward of a slice is a zero-filled gradient of the whole input with the slice's rows copied in,
which the engine then adds to the input's gradient: split into `n` tiles, a sequence-long tensor costs `n`
whole-size zero-fills and additions in backward (O(n x T) memory traffic: at 2M tokens of an 8B model,
512 tiles of 16 GiB each per layer) and one whole-size temporary next to the accumulated gradient. Here the
tiles' backward add their rows into one buffer of the input's size, handed to the input once after the
last tile (DeepSpeed's TiledMLP fills a preallocated input gradient the same way; this module is the split
that `tiled_mlp`, `tiled_layer` and the tiled final norm share). `GradientSum` and `release` are the mechanism,
also used by `tile_attention` for the float32 sum of every tile's dK/dV.
"""

from __future__ import annotations

import torch


class GradientSum:
    """The gradient of one tensor, summed from its pieces' into one buffer (allocated at the first piece's
    backward, in `dtype` or else the pieces' own) and handed to the tensor once by `release`, in its dtype."""

    def __init__(self, like: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        self.shape, self.dtype, self.out_dtype = like.shape, dtype, like.dtype
        self.buffer: torch.Tensor | None = None

    def add(self, index: tuple[slice, ...], grad: torch.Tensor) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.shape, dtype=self.dtype or grad.dtype, device=grad.device)
        self.buffer[index] += grad

    def take(self) -> torch.Tensor | None:
        buffer, self.buffer = self.buffer, None
        return None if buffer is None else buffer.to(self.out_dtype)


class _Release(torch.autograd.Function):
    """The tensors as their pieces' consumers read them; its backward runs after every consumer's and returns
    each tensor's summed gradient (plus any gradient of its own)."""

    @staticmethod
    def forward(ctx, sums: tuple[GradientSum, ...], *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.sums = sums
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        out = []
        for total, grad in zip(ctx.sums, grads, strict=True):
            buffer = total.take()
            out.append(grad if buffer is None else buffer if grad is None else buffer.add_(grad))
        return (None, *out)


def release(tensors: tuple[torch.Tensor, ...], sums: tuple[GradientSum, ...]) -> tuple[torch.Tensor, ...]:
    """`tensors` for consumers that add their gradients to `sums` (one per tensor) instead of returning them."""
    return _Release.apply(sums, *tensors)


class _Tile(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole: torch.Tensor, dim: int, start: int, length: int, total: GradientSum) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.index, ctx.total = (slice(None),) * dim + (slice(start, start + length),), total
        return whole.narrow(dim, start, length)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            ctx.total.add(ctx.index, grad)
        return None, None, None, None, None


def split_tiles(x: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, ...]:
    """`torch.tensor_split(x, n, dim)` (views of `x`); with autograd recording, their gradients reach `x`
    through one buffer instead of one whole-size gradient per tile."""
    if not (torch.is_grad_enabled() and x.requires_grad) or n <= 1:
        return torch.tensor_split(x, n, dim)
    dim, total = dim % x.dim(), GradientSum(x)
    (whole,) = release((x,), (total,))
    size, tiles, start = x.shape[dim], [], 0
    for i in range(n):
        length = size // n + (1 if i < size % n else 0)  # tensor_split's sizes: the first size % n are longer
        tiles.append(_Tile.apply(whole, dim, start, length, total))
        start += length
    return tuple(tiles)

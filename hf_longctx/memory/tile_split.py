"""`split_tiles(x, n, dim)`: `torch.tensor_split` whose backward writes every tile's gradient into one buffer.

Autograd's backward of a slice is a zero-filled gradient of the whole input with the slice's rows copied in,
which the engine then adds to the input's gradient: split into `n` tiles, a sequence-long tensor costs `n`
whole-size zero-fills and additions in backward (O(n x T) memory traffic: at 2M tokens of an 8B model,
512 tiles of 16 GiB each per layer) and one whole-size temporary next to the accumulated gradient. Here the
tiles' backward add their rows into one buffer of the input's size, handed to the input once after the
last tile (DeepSpeed's TiledMLP fills a preallocated input gradient the same way; this module is the split
that `tiled_mlp`, `tiled_layer` and the tiled final norm share).
"""

from __future__ import annotations

import torch


class _TileGradients:
    """The input's gradient, assembled from its tiles' (allocated at the first tile's backward)."""

    def __init__(self, x: torch.Tensor, dim: int) -> None:
        self.shape, self.dim = x.shape, dim
        self.buffer: torch.Tensor | None = None

    def add(self, start: int, grad: torch.Tensor) -> None:
        if self.buffer is None:
            self.buffer = torch.zeros(self.shape, dtype=grad.dtype, device=grad.device)
        self.buffer.narrow(self.dim, start, grad.shape[self.dim]).add_(grad)

    def take(self) -> torch.Tensor | None:
        buffer, self.buffer = self.buffer, None
        return buffer


class _Whole(torch.autograd.Function):
    """The input as its tiles read it; its backward runs after every tile's (they are its consumers) and
    returns their assembled gradient (plus any gradient of its own)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grads: _TileGradients) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.grads = grads
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        buffer = ctx.grads.take()
        if grad is not None:
            buffer = grad if buffer is None else buffer.add_(grad)
        return buffer, None


class _Tile(torch.autograd.Function):
    @staticmethod
    def forward(ctx, whole: torch.Tensor, start: int, length: int, grads: _TileGradients) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.start, ctx.grads = start, grads
        return whole.narrow(grads.dim, start, length)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is not None:
            ctx.grads.add(ctx.start, grad)
        return None, None, None, None


def split_tiles(x: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, ...]:
    """`torch.tensor_split(x, n, dim)` (views of `x`); with autograd recording, their gradients reach `x`
    through one buffer instead of one whole-size gradient per tile."""
    if not (torch.is_grad_enabled() and x.requires_grad) or n <= 1:
        return torch.tensor_split(x, n, dim)
    dim = dim % x.dim()
    grads = _TileGradients(x, dim)
    whole = _Whole.apply(x, grads)
    size, tiles, start = x.shape[dim], [], 0
    for i in range(n):
        length = size // n + (1 if i < size % n else 0)  # tensor_split's sizes: the first size % n are longer
        tiles.append(_Tile.apply(whole, start, length, grads))
        start += length
    return tuple(tiles)

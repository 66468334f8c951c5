"""`split_tiles`: the tiles of `torch.tensor_split`, with one whole-size gradient buffer in backward."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_longctx.memory.tile_split import split_tiles


class _WholeSizeOps(TorchDispatchMode):
    """Counts the ops that produce a tensor of `shape` (a zero-filled gradient, an addition of two)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape, self.names = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(out, "shape", None) == self.shape:
            self.names.append(func.overloadpacket.__name__)
        return out


@pytest.mark.parametrize("n, size", [(16, 64), (3, 37), (5, 3)])  # 5 tiles of 3 rows: two are empty
def test_tiles_and_gradients_equal_tensor_split(n, size):
    torch.manual_seed(0)
    x = torch.randn(2, size, 8, requires_grad=True)
    w = torch.randn(2, size, 8)
    tiles, ref = split_tiles(x, n, dim=1), torch.tensor_split(x, n, dim=1)
    assert [t.shape for t in tiles] == [r.shape for r in ref]
    assert all(torch.equal(t, r) for t, r in zip(tiles, ref, strict=True))

    def loss(parts):  # two consumers per tile; the last tile unused (its rows get no gradient)
        return sum((p * w.narrow(1, 0, p.shape[1])).sum() + (p**2).sum() for p in parts[:-1])

    (got,) = torch.autograd.grad(loss(tiles), x)
    (want,) = torch.autograd.grad(loss(ref), x)
    assert torch.equal(got, want)


def test_backward_makes_one_whole_size_buffer_not_one_per_tile():
    x = torch.randn(1, 512, 16, requires_grad=True)
    counts = {}
    for split in (torch.tensor_split, split_tiles):
        loss = sum((2 * t).sum() for t in split(x, 16, 1))
        with _WholeSizeOps(x.shape) as mode:
            (grad,) = torch.autograd.grad(loss, x)
        assert torch.equal(grad, torch.full_like(x, 2.0))
        counts[split.__name__] = mode.names
    assert len(counts["tensor_split"]) >= 16, counts  # autograd's slice backward: a whole-size gradient per tile
    assert counts["split_tiles"] == ["zeros"], counts  # one buffer, each tile added into its rows


def test_without_autograd_it_is_tensor_split():
    x = torch.randn(1, 10, 4)
    with torch.no_grad():
        tiles = split_tiles(x.requires_grad_(), 3, dim=-2)
    assert all(t.grad_fn is None for t in tiles) and [t.shape[1] for t in tiles] == [4, 3, 3]

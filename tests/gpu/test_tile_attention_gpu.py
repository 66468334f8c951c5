"""`tiled_layer`'s attention on one GPU: query tiles against the whole sequence's K/V on the block kernels the ring
uses (`choose_kernel`: torch's FlashAttention-2 in fp16/bf16, or flash-attn when installed; the memory-efficient
kernel in fp32), every tile's dK/dV summed in float32, against float64 autograd. fp16/bf16 are held to the error of
one whole-sequence call of the same kernel (x2), plus one rounding of each tile's pieces (slack tiles * eps).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_longctx.attention.lse.choose import choose_kernel
from hf_longctx.attention.ring.virtual import reference
from hf_longctx.memory.tile_attention import KVGradients, plan_pieces, release_kv, tile_attention

pytestmark = pytest.mark.gpu
EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-10}


def _tiled(q, k, v, dout, segments, tile, runs, scale):
    """Every query tile's attention and gradients; `runs` > 1 splits each tile's queries into runs that read
    overlapping prefixes (the Ulysses layout)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grads = KVGradients()
    kt, vt = release_kv(k, v, grads)
    seq, outs = q.shape[2], []
    bounds = list(range(0, seq, tile)) + [seq]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        cut = a + (b - a) // runs if runs > 1 and b - a > 1 else b
        spans = [(0, a, cut - a)] + ([(cut - a, cut, b - cut)] if cut < b else [])
        outs.append(tile_attention(q[:, :, a:b], kt, vt, plan_pieces(segments, spans), scale, grads))
    out = torch.cat(outs, dim=2)
    return out.detach(), *torch.autograd.grad(out, (q, k, v), dout)


def _case(dtype, seq, lengths, tile, runs, heads, d):
    g = torch.Generator(device="cuda").manual_seed(runs)
    q = torch.randn(1, heads[0], seq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(1, heads[1], seq, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn(1, heads[0], seq, d, device="cuda", dtype=dtype, generator=g)
    segments, start = [], 0
    for n in lengths:
        segments.append((start, start + n))
        start += n
    assert start == seq
    doc = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(lengths)])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    ref = reference(q, k, v, dout, allowed, d**-0.5)
    got = _tiled(q, k, v, dout, [segments], tile, runs, d**-0.5)
    single = _tiled(q, k, v, dout, [segments], seq, 1, d**-0.5)
    kernel = choose_kernel("cuda", dtype, masked=False, head_dims=(d, d)).name
    if dtype != torch.float32:
        flash_attn = importlib.util.find_spec("flash_attn") is not None
        assert kernel.startswith("flash_attn" if flash_attn else "torch_flash"), kernel
    tiles = -(-seq // tile)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, single, ref, strict=True):
        assert not bool(a.isnan().any()), name
        err, base = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
        bound = 2 * base + min(tiles, 8) * EPS[dtype] * c.abs().max().item()
        assert err <= bound, (name, err, base, bound, kernel)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("runs", [1, 2])
def test_tile_attention_on_gpu_matches_float64(dtype, runs):
    """Odd lengths: 511 tokens in tiles of 101, three packed documents cut by the tiles."""
    _case(dtype, 511, (300, 17, 194), 101, runs, (8, 2), 64)


def test_tile_attention_in_bf16_at_the_2m_plans_tile_size():
    """Tiles of 4,096 tokens (the auto tile of an 8B model: max(hidden, 4096)), head size 128, MQA, two packed
    documents and a last tile of 3 tokens."""
    _case(torch.bfloat16, 8195, (5003, 3192), 4096, 1, (4, 1), 128)

"""`tiled_layer`'s attention on one GPU: query tiles against the whole sequence's K/V with the CUDA kernel
`choose_kernel` picks (flash-attn when installed: K/V read as strided views; torch's memory-efficient kernel
otherwise), every tile's dK/dV summed in float32, against float64 autograd. bf16 / fp16 are held to the error of
one whole-sequence call of the same kernel (x2 + slack), as the ring's GPU test does."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_longctx.attention.ring.lse_kernels import choose_kernel
from hf_longctx.memory.tile_attention import KVGradients, plan_pieces, release_kv, tile_attention

pytestmark = pytest.mark.gpu


def _reference(q, k, v, dout, allowed, scale):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    out = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(g, 1)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def _tiled(q, k, v, dout, segments, tiles, runs, scale):
    """Every query tile's attention and gradients; `runs` > 1 splits each tile's queries into runs that read
    overlapping prefixes (the Ulysses layout)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    grads = KVGradients()
    kt, vt = release_kv(k, v, grads)
    seq, outs = q.shape[2], []
    bounds = torch.linspace(0, seq, tiles + 1).long().tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        cut = a + (b - a) // runs if runs > 1 else b
        spans = [(0, a, cut - a)] + ([(cut - a, cut, b - cut)] if runs > 1 else [])
        outs.append(tile_attention(q[:, :, a:b], kt, vt, plan_pieces(segments, spans), scale, grads))
    out = torch.cat(outs, dim=2)
    return out.detach(), *torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("runs", [1, 2])
def test_tile_attention_on_gpu_matches_float64(dtype, runs):
    g = torch.Generator(device="cuda").manual_seed(runs)
    bs, h, hkv, seq, d = 1, 8, 2, 640, 64
    q = torch.randn(bs, h, seq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(bs, hkv, seq, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn(bs, h, seq, d, device="cuda", dtype=dtype, generator=g)
    lengths = (300, 17, 323)  # three packed documents, tiles cut through them
    segments, start = [], 0
    for n in lengths:
        segments.append((start, start + n))
        start += n
    doc = torch.cat([torch.full((n,), i, device="cuda") for i, n in enumerate(lengths)])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
    ref = _reference(q, k, v, dout, allowed, d**-0.5)
    got = _tiled(q, k, v, dout, [segments], 5, runs, d**-0.5)
    single = _tiled(q, k, v, dout, [segments], 1, 1, d**-0.5)
    kernel = choose_kernel("cuda", dtype, masked=False).name
    if dtype != torch.float32 and importlib.util.find_spec("flash_attn") is not None:
        assert kernel.startswith("flash_attn"), kernel  # the strided, write-in-place path is the one under test
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, single, ref, strict=True):
        assert not bool(a.isnan().any()), name
        err, base = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
        assert err <= 2 * base + 1e-3 * c.abs().max().item(), (name, err, base)

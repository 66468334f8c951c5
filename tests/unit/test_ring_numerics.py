"""The block merge and the block kernels at the edges of their numbers (issue 38, item 3).

- Scores of 100 and more: `exp` overflows float32 from 88.7 on, so the running LSE must be merged as
  `logaddexp`; every other test draws unit-variance inputs (LSE under ~10). Float32 and bfloat16 inputs, at the
  merge alone, through the ring's blocks and through tiled_layer's tiles. Each of these fails when the merge's
  `logaddexp(a, b)` is replaced by `log(exp(a) + exp(b))`.
- The bf16 / fp16 ring-gradient bound (docs/backends.md): each of the up-to-P block pieces of a gradient element is
  rounded once to the input dtype by its kernel before the float32 sum, so the ring's error is within the one-call
  kernel's own error plus u * sum_j |g_j| (u = 2^-8 for bf16, 2^-11 for fp16; g_j the element's exact piece from
  block j; at most P u max_j |g_j|); the output within it plus u * max |V| (every block output is a convex
  combination of V rows, rounded once).
- A row that sees no key anywhere (merged LSE -inf): the mask kernels' backward (CPU flash, the memory-efficient
  stand-in, which computes exp(s - LSE) as the real kernel does) give zero gradients, not NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_longctx.attention.lse.choose import select_kernel
from hf_longctx.attention.lse.cpu import CpuFlashKernel, MathKernel
from hf_longctx.attention.lse.efficient import EfficientKernel
from hf_longctx.attention.lse.merge import merge_block
from hf_longctx.attention.ring.plan import VisibilityRule
from hf_longctx.attention.ring.virtual import reference, virtual_ring
from hf_longctx.memory import tile_attention as T
from tests._cuda_standins import AtenOps

LARGE = 40.0  # q scaled so that the largest scaled scores, and so the LSEs, reach well over 100
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _inputs(dtype, seq=96, heads=(4, 2), d=16, q_scale=1.0, seed=0, bs=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bs, heads[0], seq, d, generator=g) * q_scale
    k, v = (torch.randn(bs, heads[1], seq, d, generator=g) for _ in range(2))
    dout = torch.randn(bs, heads[0], seq, d, generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def _max_lse(q, k, allowed, scale) -> float:
    s = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2) * scale
    return float(torch.logsumexp(s.masked_fill(~allowed, -math.inf), -1).max())


def _within(errors, base, want, lse_max: float) -> None:
    """Each error within twice the one-call kernel's plus the float32 accumulators' conditioning: an LSE L is
    known to 2^-24 |L|, which every probability exp(s - L) inherits (8 of those, times the value's scale)."""
    for name, err, one, ref in zip(("out", "dq", "dk", "dv"), errors, base, want, strict=True):
        assert not math.isnan(err), name
        assert err <= 2 * one + 8 * 2.0**-24 * lse_max * float(ref.abs().max()), (name, err, one, lse_max)


def _errors(got, want) -> list[float]:
    return [float((a.double() - b).abs().max()) for a, b in zip(got, want, strict=True)]


def _one_call(q, k, v, dout, allowed, scale) -> tuple[torch.Tensor, ...]:
    """The same attention in one call of torch's CPU flash kernel at the inputs' dtype: (out, dq, dk, dv)."""
    kernel = CpuFlashKernel()
    out, lse = kernel.forward(q, k, v, causal=False, allowed=allowed, scale=scale)
    return (out, *kernel.backward(dout, q, k, v, out, lse, causal=False, allowed=allowed, scale=scale))


# ---- scores of 100+


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16])
def test_merge_of_blocks_with_lse_over_100_equals_one_softmax(block_dtype):
    """Three key blocks of one row set, scores up to ~250: the float32 running result equals one float64 softmax."""
    q, k, v, _ = _inputs(torch.float64, seq=48, q_scale=LARGE, bs=1)
    full_out, full_lse = MathKernel().forward(q, k, v, causal=False, allowed=None, scale=0.25)
    assert float(full_lse.max()) > 100 and float(full_lse.min()) > 0
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:-1], -math.inf, dtype=torch.float32)
    for cols in (slice(0, 10), slice(10, 30), slice(30, 48)):
        o, lb = MathKernel().forward(q, k[:, :, cols], v[:, :, cols], causal=False, allowed=None, scale=0.25)
        merge_block(out, lse, o.to(block_dtype), lb.float(), slice(0, 48))
    assert not bool(out.isnan().any())
    # The block outputs' own rounding, and the float32 LSE's conditioning (see `_within`).
    u = 2.0**-24 * float(full_lse.max()) + (0.0 if block_dtype == torch.float32 else 2.0**-8)
    torch.testing.assert_close(lse.double(), full_lse, rtol=1e-6, atol=0)
    assert float((out.double() - full_out).abs().max()) <= 4 * u * float(v.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("world", "layout"), [(2, "zigzag"), (4, "contiguous")])
def test_ring_blocks_with_scores_over_100_match_float64(dtype, world, layout):
    """The ring's plans, CPU kernels and merge (every rank, one process) with LSEs over 100, packed rows and a
    window: within twice the one-call kernel's error (float32: plus 1e-6 of the scale)."""
    q, k, v, dout = _inputs(dtype, q_scale=LARGE)
    doc = torch.tensor([[0] * 40 + [1] * 56, [0] * 96])
    rule = VisibilityRule(doc, window=30, tile_rows=16)
    pos = torch.arange(96)
    allowed = rule.allowed(pos, pos)[:, None]
    lse_max = _max_lse(q, k, allowed, 0.25)
    assert lse_max > 100
    want = reference(q, k, v, dout, allowed, 0.25)
    got = virtual_ring(q, k, v, dout, world, layout, rule, 0.25, lambda q_, plan: select_kernel(q_, plan))
    _within(_errors(got, want), _errors(_one_call(q, k, v, dout, allowed, 0.25), want), want, lse_max)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_attention_with_scores_over_100_matches_float64(dtype):
    """tiled_layer's tile attention (prefix + diagonal pieces of two documents, five tiles) with LSEs over 100."""
    seq, lengths = 120, (70, 50)
    q, k, v, dout = _inputs(dtype, seq=seq, q_scale=LARGE, bs=1)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    lse_max = _max_lse(q, k, allowed, 0.25)
    assert lse_max > 100
    base = _errors(_one_call(q, k, v, dout, allowed[None, None], 0.25), reference(q, k, v, dout, allowed, 0.25))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grads = T.KVGradients()
    kt, vt = T.release_kv(k, v, grads)
    bounds = [0, 17, 48, 70, 101, 120]
    segments = [[(0, 70), (70, 120)]]
    out = torch.cat(
        [T.tile_attention(q[:, :, a:b], kt, vt, T.plan_pieces(segments, [(0, a, b - a)]), 0.25, grads)
         for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=2,
    )  # fmt: skip
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    want = reference(q.detach(), k.detach(), v.detach(), dout, allowed, 0.25)
    _within(_errors(got, want), base, want, lse_max)


# ---- the bf16 / fp16 ring-gradient bound


class _AbsPieces:
    """The math kernel in float64 whose backward returns |g_j|: a virtual ring with it sums sum_j |g_j|."""

    name = "abs_pieces"

    def forward(self, *args, **kwargs):
        return MathKernel().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        return tuple(g.abs() for g in MathKernel().backward(*args, **kwargs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("kind", ["causal", "packed_window"])
def test_half_precision_ring_gradients_stay_within_the_documented_bound(dtype, world, kind):
    seq = 256
    q, k, v, dout = _inputs(dtype, seq=seq, seed=world)
    doc = torch.tensor([[0] * 100 + [1] * 3 + [2] * 153, [0] * seq])
    rule = VisibilityRule(None) if kind == "causal" else VisibilityRule(doc, window=40)
    pos = torch.arange(seq)
    allowed = rule.allowed(pos, pos)[:, None]
    want = reference(q, k, v, dout, allowed, 0.25)
    got = virtual_ring(q, k, v, dout, world, "zigzag", rule, 0.25, lambda q_, plan: select_kernel(q_, plan))
    one = _one_call(q, k, v, dout, allowed, 0.25)
    pieces = virtual_ring(*(t.double() for t in (q, k, v, dout)), world, "zigzag", rule, 0.25, lambda *a: _AbsPieces())
    u = UNIT_ROUNDOFF[dtype]
    slack = [u * float(v.double().abs().max())] + [u * float(p.max()) for p in pieces[1:]]
    for name, err, base, extra, ref in zip(("out", "dq", "dk", "dv"), _errors(got, want), _errors(one, want), slack,
                                           want, strict=True):  # fmt: skip
        assert err <= base + extra, (name, err, base, extra)
        assert base + extra <= 0.05 * float(ref.abs().max()), (name, base, extra)  # the bound says something


def test_dropping_one_ring_piece_breaks_the_bound():
    """The bound is tight enough to see a lost block: one block's gradients left out are far outside it."""
    q, k, v, dout = _inputs(torch.bfloat16, seq=128)
    rule = VisibilityRule(None)
    pos = torch.arange(128)
    want = reference(q, k, v, dout, rule.allowed(pos, pos)[:, None], 0.25)
    calls = []

    class _LoseOne(CpuFlashKernel):
        def backward(self, *args, **kwargs):
            grads = super().backward(*args, **kwargs)
            calls.append(1)
            return tuple(torch.zeros_like(g) for g in grads) if len(calls) == 2 else grads

    got = virtual_ring(q, k, v, dout, 2, "zigzag", rule, 0.25, lambda *a: _LoseOne())
    one = _one_call(q, k, v, dout, rule.allowed(pos, pos)[:, None], 0.25)
    pieces = virtual_ring(*(t.double() for t in (q, k, v, dout)), 2, "zigzag", rule, 0.25, lambda *a: _AbsPieces())
    err, base = _errors(got, want)[2], _errors(one, want)[2]
    assert err > base + UNIT_ROUNDOFF[torch.bfloat16] * float(pieces[2].max())


# ---- a row without any visible key: zero gradients, not NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["cpu_flash", "cuda_efficient"])
def test_mask_kernels_give_a_row_without_keys_anywhere_zero_gradients(kernel, dtype):
    block = CpuFlashKernel() if kernel == "cpu_flash" else EfficientKernel(AtenOps())
    q, k, v, dout = _inputs(dtype, seq=40, bs=1)
    allowed = torch.ones(1, 1, 40, 40, dtype=torch.bool).tril()
    allowed[..., 7, :] = False  # row 7 sees nothing, in this block and (its merged LSE is -inf) anywhere else
    out, lse = block.forward(q, k, v, causal=False, allowed=allowed, scale=0.25)
    assert bool((lse[..., 7] == -math.inf).all()) and bool((out[..., 7, :] == 0).all())
    dq, dk, dv = block.backward(dout, q, k, v, out, lse, causal=False, allowed=allowed, scale=0.25)
    for g in (dq, dk, dv):
        assert not bool(g.isnan().any()), kernel
    assert bool((dq[..., 7, :] == 0).all())
    want = MathKernel().backward(*(t.double() for t in (dout, q, k, v, out, lse)), causal=False, allowed=allowed,
                                 scale=0.25)  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for g, w in zip((dq, dk, dv), want, strict=True):
        assert float((g.double() - w).abs().max()) <= tol * float(w.abs().max())

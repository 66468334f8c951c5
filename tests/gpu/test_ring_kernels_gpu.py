"""The ring's CUDA block kernels (flash-attn 2/3 when installed, torch's memory-efficient kernel) on one GPU.

No second GPU is needed: a "virtual ring" loops over P ranks in one process with the same planner, kernels
and merge the ring runs per step (`plan_ring`, `select_kernel`, `merge_block`, the backward with the merged
output and LSE), and compares every rank's output and dq/dk/dv with float64 autograd of an explicit masked
softmax. bf16/fp16 are held to the single-call error of the same kernel family (x2 + slack), as on CPU.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.attention.ring.lse_kernels import lse_dtype, select_kernel
from hf_longctx.attention.ring.plan import VisibilityRule, fix_empty_rows, merge_block, plan_ring
from hf_longctx.data.layout import layout_indices

pytestmark = pytest.mark.gpu


def _reference(q, k, v, dout, allowed, scale):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    out = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(g, 1)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def _virtual_ring(q, k, v, dout, world, layout, rule, scale):
    """Each rank's output and gradients, computed block by block as the ring does."""
    seq = q.shape[2]
    idx = [layout_indices(layout, r, world, seq).cuda() for r in range(world)]
    outs, dq, dk, dv = torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(world):
        plans = plan_ring(idx, rank, rule)
        ql, dol = q[:, :, idx[rank]], dout[:, :, idx[rank]]
        out = torch.zeros(ql.shape, dtype=lse_dtype(q.dtype), device=q.device)
        lse = torch.full(ql.shape[:-1], float("-inf"), dtype=out.dtype, device=q.device)
        for src, plan in enumerate(plans):
            if plan is None:
                continue
            kb, vb = k[:, :, idx[src]][:, :, plan.cols], v[:, :, idx[src]][:, :, plan.cols]
            kernel = select_kernel(ql, plan)
            o, lb = kernel.forward(
                ql[:, :, plan.rows],
                kb,
                vb,
                causal=plan.causal,
                allowed=plan.allowed,
                scale=scale,
                segments=plan.segments,
            )
            merge_block(out, lse, o, fix_empty_rows(lb, plan), plan.rows)
        out = out.to(q.dtype)
        outs[:, :, idx[rank]] = out
        for src, plan in enumerate(plans):
            if plan is None:
                continue
            r, c = plan.rows, plan.cols
            kb, vb = k[:, :, idx[src]][:, :, c], v[:, :, idx[src]][:, :, c]
            kernel = select_kernel(ql, plan)
            gq, gk, gv = kernel.backward(
                dol[:, :, r], ql[:, :, r], kb, vb, out[:, :, r], lse[:, :, r],
                causal=plan.causal, allowed=plan.allowed, scale=scale, segments=plan.segments,
            )  # fmt: skip
            dq[:, :, idx[rank][r]] += gq
            dk[:, :, idx[src][c]] += gk
            dv[:, :, idx[src][c]] += gv
    return outs, dq, dk, dv


RULES = ("causal", "packed", "packed_window")


def _rule(kind: str, seq: int) -> VisibilityRule:
    """Packed rows differ per batch row (rows of a block that see no key); the window gives masks of
    odd crop widths (the memory-efficient kernel's bias alignment)."""
    rows = [(100, 1, 211, 200), (50, 300, 162)]
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows]).cuda()
    assert doc.shape[1] == seq
    return VisibilityRule(None if kind == "causal" else doc, window=37 if kind == "packed_window" else None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("kind", RULES)
def test_virtual_ring_on_gpu_matches_float64(dtype, world, kind):
    g = torch.Generator(device="cuda").manual_seed(world)
    bs, h, hkv, seq, d = 2, 8, 2, 512, 64
    q = torch.randn(bs, h, seq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(bs, hkv, seq, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(bs, hkv, seq, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(bs, h, seq, d, device="cuda", dtype=dtype, generator=g)
    rule = _rule(kind, seq)
    allowed = rule.allowed(torch.arange(seq, device="cuda"), torch.arange(seq, device="cuda"))[:, None]
    ref = _reference(q, k, v, dout, allowed, d**-0.5)
    got = _virtual_ring(q, k, v, dout, world, "zigzag", rule, d**-0.5)
    single = _virtual_ring(q, k, v, dout, 1, "contiguous", rule, d**-0.5)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, single, ref, strict=True):
        assert not bool(a.isnan().any()), name
        err, base = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
        assert err <= 2 * base + 1e-3 * c.abs().max().item(), (name, err, base)


def test_packed_blocks_take_a_varlen_kernel_on_gpu():
    seq, world = 512, 4
    idx = [layout_indices("zigzag", r, world, seq).cuda() for r in range(world)]
    q = torch.zeros(2, 8, seq // world, 64, device="cuda", dtype=torch.bfloat16)
    plans = [p for r in range(world) for p in plan_ring(idx, r, _rule("packed", seq)) if p is not None]
    names = {select_kernel(q, p).name for p in plans if p.segments is not None}
    assert names and all(n.endswith("varlen") for n in names), names

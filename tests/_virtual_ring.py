"""Ring attention's block loop for every rank in one process (no process group): the same planner, kernels and
merge the ring runs per step, and the backward with the merged output and LSE. Shared by the CPU contract tests
(stand-in CUDA ops) and the GPU kernel tests."""

from __future__ import annotations

import torch

from hf_longctx.attention.lse.contract import lse_dtype
from hf_longctx.attention.lse.merge import merge_block
from hf_longctx.attention.ring.plan import VisibilityRule, plan_ring
from hf_longctx.data.layout import layout_indices


def reference(q, k, v, dout, allowed, scale):
    """float64 autograd of explicit masked softmax attention: (out, dq, dk, dv)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    out = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(g, 1)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def virtual_ring(q, k, v, dout, world, layout, rule: VisibilityRule, scale, kernel_for):
    """Every rank's out and dq/dk/dv (global order), block by block; `kernel_for(q_local, plan)` picks a kernel."""
    seq = q.shape[2]
    idx = [layout_indices(layout, r, world, seq).to(q.device) for r in range(world)]
    outs, dq, dk, dv = (torch.zeros(t.shape, dtype=lse_dtype(q.dtype), device=q.device) for t in (q, q, k, v))
    for rank in range(world):
        plans = plan_ring(idx, rank, rule)
        ql, dol = q[:, :, idx[rank]], dout[:, :, idx[rank]]
        out = torch.zeros(ql.shape, dtype=lse_dtype(q.dtype), device=q.device)
        lse = torch.full(ql.shape[:-1], float("-inf"), dtype=out.dtype, device=q.device)
        for src, plan in enumerate(plans):
            if plan is not None:
                kb, vb = k[:, :, idx[src]][:, :, plan.cols], v[:, :, idx[src]][:, :, plan.cols]
                o, lb = kernel_for(ql, plan).forward(
                    ql[:, :, plan.rows], kb, vb, causal=plan.causal, allowed=plan.allowed, scale=scale,
                    segments=plan.segments,
                )  # fmt: skip
                merge_block(out, lse, o, lb, plan.rows)
        out = out.to(q.dtype)
        outs[:, :, idx[rank]] = out.to(outs.dtype)
        for src, plan in enumerate(plans):
            if plan is not None:
                r, c = plan.rows, plan.cols
                kb, vb = k[:, :, idx[src]][:, :, c], v[:, :, idx[src]][:, :, c]
                gq, gk, gv = kernel_for(ql, plan).backward(
                    dol[:, :, r], ql[:, :, r], kb, vb, out[:, :, r], lse[:, :, r],
                    causal=plan.causal, allowed=plan.allowed, scale=scale, segments=plan.segments,
                )  # fmt: skip
                dq[:, :, idx[rank][r]] += gq
                dk[:, :, idx[src][c]] += gk
                dv[:, :, idx[src][c]] += gv
    return outs, dq, dk, dv

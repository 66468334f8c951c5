"""Ring attention's block loop for every rank in one process: what one device can check of the block kernels,
the plans and the merge without a process group.

`virtual_ring` runs the planner, kernels and merge the ring runs per step (`attention.py`), the backward with the
merged output and LSE, for every rank of a ring in turn; `reference` is float64 autograd of an explicit masked
softmax. The GPU tests (tests/gpu) and `benchmarks/gpu_kernels.py` compare the two on one GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.attention.lse.contract import BlockKernel, lse_dtype
from hf_longctx.attention.lse.merge import merge_block
from hf_longctx.attention.ring.plan import VisibilityRule, plan_ring
from hf_longctx.data.layout import layout_indices

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def reference(q, k, v, dout, allowed: torch.Tensor, scale: float) -> Outputs:
    """float64 autograd of masked softmax attention (`allowed` `[bs or 1, 1, sq, sk]`): (out, dq, dk, dv)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    out = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(g, 1)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.double()))


def virtual_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    world: int,
    layout: str,
    rule: VisibilityRule,
    scale: float,
    kernel_for: Callable[[torch.Tensor, Any], BlockKernel],
) -> Outputs:
    """Every rank's out and dq/dk/dv in global order (accumulated in `lse_dtype`), block by block.

    Args:
        q, k, v, dout: the whole row, `[bs, hc(_kv), sl, hs]`.
        world: ring size; `layout`: its token layout ("contiguous" or "zigzag").
        rule: who sees whom; `scale`: the softmax scale.
        kernel_for: `(local queries, plan) -> kernel` (the ring uses `select_kernel`).
    """
    seq = q.shape[2]
    idx = [layout_indices(layout, r, world, seq).to(q.device) for r in range(world)]
    outs, dq, dk, dv = (torch.zeros(t.shape, dtype=lse_dtype(q.dtype), device=q.device) for t in (q, q, k, v))
    for rank in range(world):
        plans = plan_ring(idx, rank, rule)
        ql, dol = q[:, :, idx[rank]], dout[:, :, idx[rank]]
        out = torch.zeros(ql.shape, dtype=lse_dtype(q.dtype), device=q.device)
        lse = torch.full(ql.shape[:-1], float("-inf"), dtype=out.dtype, device=q.device)
        for src, plan in ((src, p) for src, parts in enumerate(plans) for p in parts):
            b = plan.batch_rows
            kb, vb = k[b][:, :, idx[src]][:, :, plan.cols], v[b][:, :, idx[src]][:, :, plan.cols]
            o, lb = kernel_for(ql, plan).forward(
                ql[b, :, plan.rows], kb, vb, causal=plan.causal, allowed=plan.allowed, scale=scale,
                segments=plan.segments,
            )  # fmt: skip
            merge_block(out[b], lse[b], o, lb, plan.rows)
        out = out.to(q.dtype)  # what the ring saves for backward
        outs[:, :, idx[rank]] = out.to(outs.dtype)
        for src, plan in ((src, p) for src, parts in enumerate(plans) for p in parts):
            b, r, c = plan.batch_rows, plan.rows, plan.cols
            kb, vb = k[b][:, :, idx[src]][:, :, c], v[b][:, :, idx[src]][:, :, c]
            gq, gk, gv = kernel_for(ql, plan).backward(
                dol[b, :, r], ql[b, :, r], kb, vb, out[b, :, r], lse[b, :, r],
                causal=plan.causal, allowed=plan.allowed, scale=scale, segments=plan.segments,
            )  # fmt: skip
            dq[b, :, idx[rank][r]] += gq
            dk[b, :, idx[src][c]] += gk
            dv[b, :, idx[src][c]] += gv
    return outs, dq, dk, dv

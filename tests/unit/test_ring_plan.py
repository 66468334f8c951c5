"""Ring attention's pure parts: block plans vs brute force, the LSE merge, the CPU/math kernels, and the
flash-attn signature probe (with stand-in functions: no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.attention.lse.cpu import CpuFlashKernel, MathKernel
from hf_longctx.attention.lse.flash_attn import flash_call_kwargs
from hf_longctx.attention.lse.merge import merge_block
from hf_longctx.attention.ring.plan import VisibilityRule, plan_ring
from hf_longctx.data.layout import layout_indices


def _covered(plans, nq, nk, bs) -> torch.Tensor:
    """Boolean [bs, nq, nk]: the pairs a block's plans hand to the kernels as visible; no pair twice."""
    out = torch.zeros(bs, nq, nk, dtype=torch.bool)
    for plan in plans:
        n, m = plan.rows.stop - plan.rows.start, plan.cols.stop - plan.cols.start
        mask = plan.mask(bs)
        crop = torch.ones(1, n, m, dtype=torch.bool) if mask is None else mask[:, 0]
        if plan.causal:
            crop = crop.tril()
        target = out[plan.batch_rows, plan.rows, plan.cols]
        assert not (target & crop).any(), f"a pair planned twice: {plan}"
        out[plan.batch_rows, plan.rows, plan.cols] = target | crop
    return out


RULES = {
    "causal": lambda pos, doc: VisibilityRule(None),
    "packed": lambda pos, doc: VisibilityRule(doc),
    "window": lambda pos, doc: VisibilityRule(None, window=5),
    "packed_window_chunk": lambda pos, doc: VisibilityRule(doc, window=7, chunk=4, position_ids=pos),
    "packed_chunk": lambda pos, doc: VisibilityRule(doc, chunk=4, position_ids=pos),
    "chunk": lambda pos, doc: VisibilityRule(None, chunk=8, position_ids=torch.arange(32).expand(2, 32)),
    "window_tiles": lambda pos, doc: VisibilityRule(None, window=3, tile_rows=2),
    "packed_window_tiles": lambda pos, doc: VisibilityRule(doc, window=6, tile_rows=4),
}


@pytest.mark.parametrize("rule_name", sorted(RULES))
@pytest.mark.parametrize(("kind", "world"), [("contiguous", 2), ("zigzag", 2), ("contiguous", 4), ("zigzag", 4)])
def test_plans_cover_exactly_the_visible_pairs(rule_name, kind, world):
    seq = 32
    lengths = [(5, 1, 14, 12), (16, 16)]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    rule = RULES[rule_name](pos, doc)
    indices = [layout_indices(kind, r, world, seq) for r in range(world)]
    for rank in range(world):
        for src, plans in enumerate(plan_ring(indices, rank, rule)):
            want = rule.allowed(indices[rank], indices[src])
            got = _covered(plans, len(indices[rank]), len(indices[src]), doc.shape[0])
            assert torch.equal(got, want.expand_as(got)), (rank, src, plans)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_balances_causal_work_and_needs_no_mask(world):
    seq = 16 * world
    indices = [layout_indices("zigzag", r, world, seq) for r in range(world)]
    for rank in range(world):
        plans = plan_ring(indices, rank, VisibilityRule(None))
        assert all(len(p) == 1 and p[0].allowed is None for p in plans)
        # Off-diagonal steps: exactly half of a block each (m x 2m or 2m x m, m = seq / 2P).
        m = seq // (2 * world)
        assert all(p[0].pairs == 2 * m * m for src, p in enumerate(plans) if src != rank)
        assert plans[rank][0].causal
    contiguous = [layout_indices("contiguous", r, world, seq) for r in range(world)]
    assert plan_ring(contiguous, 0, VisibilityRule(None))[1] == ()  # future keys: skipped


def test_merge_equals_one_softmax_over_all_keys_and_ignores_empty_blocks():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full_out, full_lse = MathKernel().forward(q, k, v, causal=False, allowed=None, scale=0.5)
    out = torch.zeros_like(full_out)
    lse = torch.full_like(full_lse, float("-inf"))
    empty = torch.zeros(1, 1, 5, 2, dtype=torch.bool)  # a block no row sees: LSE -inf, O 0
    for block, allowed in ((slice(0, 2), None), (slice(2, 5), None), (slice(0, 2), empty)):
        o, lb = MathKernel().forward(q, k[:, :, block], v[:, :, block], causal=False, allowed=allowed, scale=0.5)
        merge_block(out, lse, o, lb, slice(0, 5))
    torch.testing.assert_close(out, full_out, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, full_lse, rtol=0, atol=1e-14)
    assert not torch.isnan(out).any()


def test_cpu_kernel_turns_the_lse_zero_of_rows_without_keys_into_minus_inf():
    """torch's CPU flash kernel reports LSE 0 for a fully masked row (not -inf), which would silently down-weight
    every other block of that row in the merge: the adapter clears such rows."""
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    allowed = torch.tensor([[True, True], [False, False], [True, False]]).view(1, 1, 3, 2)
    raw = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, q[:, :, :2], q[:, :, :2], 0.0, False, attn_mask=torch.where(allowed, 0.0, float("-inf")).double()
    )[1]
    assert float(raw[0, 0, 1]) == 0.0  # the trap: not -inf
    out, lse = CpuFlashKernel().forward(q, q[:, :, :2], q[:, :, :2], causal=False, allowed=allowed, scale=1.0)
    ref_out, ref = MathKernel().forward(q, q[:, :, :2], q[:, :, :2], causal=False, allowed=allowed, scale=1.0)
    torch.testing.assert_close(lse, ref)
    torch.testing.assert_close(out, ref_out)
    assert bool((out[0, :, 1] == 0).all())


def test_long_documents_in_zigzag_blocks_are_planned_as_segments_not_masks():
    """A document longer than half the row spans both zigzag chunks of a rank: its queries form two runs of
    positions, each seeing the keys before it. Planned as two segments (keys listed in both), never as a mask."""
    seq, world = 64, 4
    doc = torch.tensor([[0] * 6 + [1] * 50 + [2] * 8])
    indices = [layout_indices("zigzag", r, world, seq) for r in range(world)]
    for rank in range(world):
        for src, plans in enumerate(plan_ring(indices, rank, VisibilityRule(doc))):
            assert len(plans) <= 1, (rank, src)
            if not plans:
                continue
            plan = plans[0]
            assert plan.allowed is None, (rank, src)
            want = VisibilityRule(doc).allowed(indices[rank], indices[src])[:, plan.rows, plan.cols]
            got = plan.mask(1)[:, 0] if plan.masked else None
            if got is not None:
                assert torch.equal(got, want), (rank, src)
    # Rank 2 holds positions 16..23 and 40..47, both of document 1; of rank 0's keys (0..7, 56..63) both runs see
    # document 1's 6 and 7: two segments listing the same two keys.
    (plan,) = plan_ring(indices, 2, VisibilityRule(doc))[0]
    assert plan.segments.cu_q.tolist() == [0, 8, 16] and plan.segments.cu_k.tolist() == [0, 2, 4]
    assert plan.segments.k_tokens.tolist() == [0, 1, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "d", "dv"), [(4, 2, 8, 8), (4, 1, 3, 3), (4, 4, 12, 8)])
def test_cpu_flash_kernel_matches_math_kernel_forward_and_backward(dtype, hq, hkv, d, dv):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, hq, 6, d, generator=g, dtype=dtype)
    k = torch.randn(2, hkv, 6, d, generator=g, dtype=dtype)
    v = torch.randn(2, hkv, 6, dv, generator=g, dtype=dtype)
    dout = torch.randn(2, hq, 6, dv, generator=g, dtype=dtype)
    allowed = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    allowed[..., 0] = True
    tol = {"rtol": 0, "atol": 1e-12 if dtype == torch.float64 else 2e-5}
    for causal, mask in ((True, None), (False, allowed)):
        cpu, math = CpuFlashKernel(), MathKernel()
        out, lse = cpu.forward(q, k, v, causal=causal, allowed=mask, scale=0.4)
        ref_out, ref_lse = math.forward(q, k, v, causal=causal, allowed=mask, scale=0.4)
        torch.testing.assert_close(out, ref_out, **tol)
        torch.testing.assert_close(lse, ref_lse, **tol)
        grads = cpu.backward(dout, q, k, v, out, lse, causal=causal, allowed=mask, scale=0.4)
        ref = math.backward(dout, q, k, v, out, lse, causal=causal, allowed=mask, scale=0.4)
        for got, want in zip(grads, ref, strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, **tol)


def _fa2_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):  # noqa: E501
    return locals()


def _fa3_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    dq,
    dk,
    dv,
    softmax_scale,
    is_causal,
    window_size_left,
    window_size_right,
    softcap,
    deterministic,
    sm_margin=0,
):  # noqa: E501
    return locals()


def _future(q, k, v, softmax_scale, causal, brand_new_required):
    return locals()


def test_flash_attn_signature_probe_fills_known_parameters_and_refuses_unknown_ones():
    kw = flash_call_kwargs(_fa2_forward, {"q": 1, "k": 2, "v": 3, "softmax_scale": 0.5, "causal": True})
    assert kw["window_size_left"] == -1 and kw["softcap"] == 0.0 and kw["causal"] is True
    given = dict.fromkeys(("dout", "q", "k", "v", "out", "softmax_lse", "dk", "dv"), 0)
    kw = flash_call_kwargs(_fa3_backward, {**given, "is_causal": False, "dq": "dq", "softmax_scale": 0.1})
    assert kw["is_causal"] is False and kw["cu_seqlens_q"] is None and kw["dq"] == "dq"
    with pytest.raises(ValueError, match="brand_new_required"):
        flash_call_kwargs(_future, {"q": 1, "k": 1, "v": 1, "softmax_scale": 1, "causal": True})

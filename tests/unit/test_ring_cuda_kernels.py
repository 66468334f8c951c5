"""The ring's CUDA kernel paths, on CPU: flash-attn's private functions as real `torch.library.custom_op`
stand-ins (`tests/_flash_standin.py`), the dispatch and its log, the varlen path for packed documents
(segments, never a dense mask; empty rows never computed) and the memory-efficient kernel's aligned bias."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hf_longctx.attention.ring import cuda_kernels as C
from hf_longctx.attention.ring import lse_kernels as L
from hf_longctx.attention.ring.plan import VisibilityRule, fix_empty_rows, merge_block, plan_block, plan_ring
from hf_longctx.data.layout import layout_indices
from tests import _flash_standin as F


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """A new process as far as kernel selection goes: no cached probe, nothing logged yet."""
    L._flash.cache_clear()
    monkeypatch.setattr(L, "_LOGGED", set())
    yield
    L._flash.cache_clear()


def _qkv(bs=2, h=4, hkv=2, n=6, m=5, d=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bs, h, n, d, generator=g, dtype=dtype)
    k, v = (torch.randn(bs, hkv, m, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(bs, h, n, d, generator=g, dtype=dtype)


def test_flash_attn_custom_ops_are_detected_and_called_with_their_arguments(monkeypatch, fresh_dispatch):
    F.install_private(monkeypatch)
    dense, varlen, found = C.detect_flash_attn()
    assert dense is not None and dense.name == "flash_attn_2" and "2.8.3" in found
    assert varlen is not None and varlen.name == "flash_attn_2_varlen"
    q, k, v, dout = _qkv(n=5)
    out, lse = dense.forward(q, k, v, causal=True, allowed=None, scale=0.3)
    ref_out, ref_lse = L.MathKernel().forward(q, k, v, causal=True, allowed=None, scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=0, atol=1e-6)
    grads = dense.backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3)
    for got, want in zip(
        grads,
        L.MathKernel().backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3),
        strict=True,
    ):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    (fwd_name, fwd), (bwd_name, bwd) = F.PRIVATE_CALLS
    assert fwd_name == "forward" and fwd["causal"] is True and fwd["softmax_scale"] == 0.3
    assert fwd["return_softmax"] is False
    assert bwd_name == "backward" and bwd["deterministic"] is True and bwd["causal"] is True


def test_flash_attn_is_chosen_on_cuda_and_the_choice_is_logged_once(monkeypatch, fresh_dispatch, caplog):
    F.install_private(monkeypatch)
    caplog.set_level(logging.INFO, logger=L.__name__)
    bf16 = torch.bfloat16
    assert L.choose_kernel("cuda", bf16, masked=False).name == "flash_attn_2"
    assert L.choose_kernel("cuda", bf16, masked=False).name == "flash_attn_2"
    assert L.choose_kernel("cuda", bf16, masked=True, varlen=True).name == "flash_attn_2_varlen"
    assert L.choose_kernel("cuda", bf16, masked=True).name == "cuda_efficient"  # window / chunk masks
    assert L.choose_kernel("cuda", torch.float32, masked=True, varlen=True).name == "cuda_efficient"
    assert L.choose_kernel("cuda", bf16, masked=True, varlen=True, same_head_size=False).name == "cuda_efficient"
    lines = [r.getMessage() for r in caplog.records if "blocks use" in r.getMessage()]
    assert lines.count("ring attention: cuda torch.bfloat16 dense blocks use the flash_attn_2 kernel") == 1
    assert "ring attention: cuda torch.bfloat16 packed blocks use the flash_attn_2_varlen kernel" in lines
    assert len(lines) == 5  # one per (device, dtype, block kind, head sizes)
    assert any("flash-attn probe: flash_attn_2" in r.getMessage() for r in caplog.records)


def test_fa3_custom_ops_are_detected_for_dense_and_varlen_blocks(monkeypatch, fresh_dispatch):
    F.install_fa3(monkeypatch)
    dense, varlen, found = C.detect_flash_attn()
    assert dense.name == "flash_attn_3" and varlen.name == "flash_attn_3_varlen" and "flash_attn_interface" in found
    q, k, v, dout = _qkv(n=5, m=5)
    ref_out, ref_lse = L.MathKernel().forward(q, k, v, causal=True, allowed=None, scale=0.3)
    out, lse = dense.forward(q, k, v, causal=True, allowed=None, scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    grads = dense.backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3)
    want = L.MathKernel().backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3)
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    doc = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    plan = plan_block(torch.arange(5), torch.arange(5), VisibilityRule(doc))
    out, _ = varlen.forward(q, k, v, causal=False, allowed=None, scale=0.3, segments=plan.segments)
    ref_out, _ = L.MathKernel().forward(q, k, v, causal=False, allowed=plan.mask(2), scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    assert [c for name, c in F.PRIVATE_CALLS if name.startswith("fa3")] == [
        {"causal": True, "varlen": False},
        {"is_causal": True, "varlen": False},
        {"causal": True, "varlen": True},
    ]


def test_old_flash_attn_is_refused_with_a_reason_and_packed_blocks_use_torch_varlen(monkeypatch, fresh_dispatch):
    F.install_private(monkeypatch, version="2.6.3")
    dense, varlen, found = C.detect_flash_attn()
    assert dense is None and varlen is None and "older than 2.7.0" in found
    assert L.choose_kernel("cuda", torch.float16, masked=False).name == "cuda_efficient"
    assert L.choose_kernel("cuda", torch.float16, masked=True, varlen=True) is C.TORCH_VARLEN


def _unknown_forward(q, k, v, softmax_scale, causal, brand_new_required):
    return q


def test_flash_call_kwargs_reads_custom_op_schemas_and_refuses_unknown_required_parameters():
    given = dict.fromkeys(("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_k", "softmax_scale"), 0)
    kw = C.flash_call_kwargs(F._flash_attn_varlen_forward, {**given, "causal": True, "max_seqlen_q": 3})
    assert kw["max_seqlen_q"] == 3 and kw["zero_tensors"] is False and kw["window_size_left"] == -1
    with pytest.raises(ValueError, match="brand_new_required"):
        C.flash_call_kwargs(_unknown_forward, {"q": 1, "k": 1, "v": 1, "softmax_scale": 1, "causal": True})


def _packed_rule(seq, lengths):
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    assert doc.shape[1] == seq
    return VisibilityRule(doc)


def test_packed_blocks_are_planned_as_segments_without_a_dense_mask(monkeypatch):
    rule = _packed_rule(32, [(5, 1, 14, 12), (16, 16)])

    def no_dense(*args):
        raise AssertionError("the packed planner built a dense mask")

    monkeypatch.setattr(VisibilityRule, "allowed", no_dense)
    indices = [layout_indices("zigzag", r, 2, 32) for r in range(2)]
    plans = [p for r in range(2) for p in plan_ring(indices, r, rule) if p is not None]
    assert any(p.segments is not None for p in plans)
    assert all(p.allowed is None for p in plans)
    for p in plans:
        if p.segments is not None:
            assert p.segments.cu_q.dtype == torch.int32 and isinstance(p.segments.max_q, int)


def _virtual_ring(q, k, v, dout, world, rule, scale, kernel_for):
    """Every rank's out and dq/dk/dv, block by block as the ring computes them (one process)."""
    seq = q.shape[2]
    idx = [layout_indices("zigzag", r, world, seq) for r in range(world)]
    outs, dq, dk, dv = (torch.zeros_like(t) for t in (q, q, k, v))
    for rank in range(world):
        plans = plan_ring(idx, rank, rule)
        ql, dol = q[:, :, idx[rank]], dout[:, :, idx[rank]]
        out = torch.zeros(ql.shape, dtype=torch.float64)
        lse = torch.full(ql.shape[:-1], -math.inf, dtype=torch.float64)
        for src, p in enumerate(plans):
            if p is not None:
                kb, vb = k[:, :, idx[src]][:, :, p.cols], v[:, :, idx[src]][:, :, p.cols]
                o, lb = kernel_for(p).forward(
                    ql[:, :, p.rows], kb, vb, causal=p.causal, allowed=p.allowed, scale=scale, segments=p.segments
                )
                merge_block(out, lse, o, fix_empty_rows(lb.double(), p), p.rows)
        outs[:, :, idx[rank]] = out
        for src, p in enumerate(plans):
            if p is not None:
                r, c = p.rows, p.cols
                kb, vb = k[:, :, idx[src]][:, :, c], v[:, :, idx[src]][:, :, c]
                gq, gk, gv = kernel_for(p).backward(
                    dol[:, :, r], ql[:, :, r], kb, vb, out[:, :, r], lse[:, :, r],
                    causal=p.causal, allowed=p.allowed, scale=scale, segments=p.segments,
                )  # fmt: skip
                dq[:, :, idx[rank][r]] += gq
                dk[:, :, idx[src][c]] += gk
                dv[:, :, idx[src][c]] += gv
    return outs, dq, dk, dv


@pytest.mark.parametrize("world", [2, 4])
def test_varlen_path_matches_float64_attention_over_packed_documents(monkeypatch, world):
    F.install_private(monkeypatch)
    _, varlen, _ = C.detect_flash_attn()
    seq = 48
    rule = _packed_rule(seq, [(10, 1, 23, 14), (3, 45)])
    q, k, v, dout = _qkv(n=seq, m=seq, seed=world)
    used = []

    def kernel_for(plan):
        used.append(plan.segments is not None)
        return varlen if plan.segments is not None else L.CpuFlashKernel()

    got = _virtual_ring(q, k, v, dout, world, rule, 0.35, kernel_for)
    pos = torch.arange(seq)
    allowed = rule.allowed(pos, pos)[:, None]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    s = (qr @ kr.repeat_interleave(2, 1).transpose(-1, -2)) * 0.35
    ref = torch.softmax(s.masked_fill(~allowed, -math.inf), -1) @ vr.repeat_interleave(2, 1)
    want = (ref.detach(), *torch.autograd.grad(ref, (qr, kr, vr), dout))
    assert any(used)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):  # flash LSEs are float32
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6 * b.abs().max().item(), msg=name)
    # The kernel only ever saw rows of some segment: cu_seqlens end at the gathered token count.
    assert all(c["cu_seqlens_q"][-1] > 0 for n, c in F.PRIVATE_CALLS if n == "varlen_forward")


def test_rows_that_see_no_key_are_zero_and_minus_inf_by_construction(monkeypatch):
    F.install_private(monkeypatch)
    _, varlen, _ = C.detect_flash_attn()
    # Queries at 8..11, keys at 0..7: row 0's document 1 spans 6..9, row 1's spans 6..8, so the crop
    # (queries 8, 9) holds a row of batch 1 that sees no key.
    doc = torch.tensor([[0] * 6 + [1] * 4 + [2] * 2, [0] * 6 + [1] * 3 + [2] * 3])
    plan = plan_block(torch.arange(8, 12), torch.arange(0, 8), VisibilityRule(doc))
    assert plan.segments is not None and plan.empty_rows.tolist() == [[False, False], [False, True]]
    q, k, v, _ = _qkv(bs=2, n=4, m=8)
    kb, vb = k[:, :, plan.cols], v[:, :, plan.cols]
    out, lse = varlen.forward(q[:, :, plan.rows], kb, vb, causal=False, allowed=None, scale=0.5, segments=plan.segments)
    assert torch.equal(out[1, :, 1], torch.zeros_like(out[1, :, 1]))
    assert bool((lse[1, :, 1] == -math.inf).all()) and bool(torch.isfinite(lse[0]).all())
    assert not bool(out.isnan().any())
    (_, call), *_ = [c for c in F.PRIVATE_CALLS if c[0] == "varlen_forward"]
    assert call["cu_seqlens_q"].tolist() == [0, 2, 3]  # the empty row never reaches the kernel


def test_merge_ignores_a_nan_output_on_rows_whose_block_lse_is_minus_inf():
    out = torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    lse = torch.full((1, 1, 2), -math.inf, dtype=torch.float64)
    merge_block(
        out, lse, torch.ones(1, 1, 2, 3, dtype=torch.float64), torch.zeros(1, 1, 2, dtype=torch.float64), slice(0, 2)
    )
    nan_row = torch.tensor([[[[1.0] * 3, [math.nan] * 3]]], dtype=torch.float64)
    merge_block(out, lse, nan_row, torch.tensor([[[0.0, -math.inf]]], dtype=torch.float64), slice(0, 2))
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out, torch.ones_like(out))
    torch.testing.assert_close(lse, torch.tensor([[[math.log(2.0), 0.0]]], dtype=torch.float64))


class _EfficientOps:
    """Records torch's memory-efficient ops' bias as the CUDA kernel would receive it; computes them in math."""

    def __init__(self):
        self.biases = []

    def _check(self, bias, q):
        assert bias.shape == (q.shape[0], q.shape[1], q.shape[2], self.nk)
        assert bias.stride(-1) == 1 and bias.stride(-2) % C.MEM_EFF_ALIGNMENT == 0, bias.stride()
        assert bias.stride(1) == 0  # heads broadcast, never copied per head
        self.biases.append(bias)
        return ~torch.isinf(bias[:, :1])

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout_p, causal, *, scale):
        assert compute_lse and dropout_p == 0.0
        out, lse = L.MathKernel().forward(q, k, v, causal=causal, allowed=self._check(bias, q), scale=scale)
        return out, torch.nn.functional.pad(lse, (0, 32 - lse.shape[-1] % 32)), None, None  # padded LSE

    def _scaled_dot_product_efficient_attention_backward(
        self, dout, q, k, v, bias, out, lse, s, o, p, need, causal, *, scale
    ):
        assert lse.shape[-1] == q.shape[2]
        allowed = self._check(bias, q)
        return (*L.MathKernel().backward(dout, q, k, v, out, lse, causal=causal, allowed=allowed, scale=scale), None)


@pytest.mark.parametrize("width", [13, 16, 21])
def test_efficient_kernel_gets_an_aligned_broadcast_bias_for_any_crop_width(width):
    ops = _EfficientOps()
    ops.nk = width
    kernel = C.CudaEfficientKernel(ops)
    q, k, v, dout = _qkv(n=7, m=width)
    allowed = torch.rand(2, 1, 7, width, generator=torch.Generator().manual_seed(width)) > 0.4
    allowed[..., 0] = True
    out, lse = kernel.forward(q, k, v, causal=False, allowed=allowed, scale=0.4)
    ref_out, ref_lse = L.MathKernel().forward(q, k, v, causal=False, allowed=allowed, scale=0.4)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse.float())
    grads = kernel.backward(dout, q, k, v, ref_out, ref_lse, causal=False, allowed=allowed, scale=0.4)
    ref = L.MathKernel().backward(dout, q, k, v, ref_out, ref_lse, causal=False, allowed=allowed, scale=0.4)
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the kernel's LSE is float32
    assert len(ops.biases) == 2


def test_tile_attention_on_flash_attn_reads_kv_in_place(monkeypatch):
    """One query tile on flash-attn's private API (the CPU stand-in, which asserts the contiguous head dim the real
    kernels need): every call reads its keys and values as views of the whole sequence's K/V (no copies) and the
    results equal dense per-document attention."""
    import torch.nn.functional as tF

    from hf_longctx.memory import tile_attention as T

    F.install_private(monkeypatch)
    dense, _, _ = C.detect_flash_attn()
    monkeypatch.setattr(T, "_kernel", lambda q, v: dense)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 20, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    segments, (a, b) = [[(0, 9), (9, 20)]], (6, 15)  # the tile: the end of one document, the start of the next
    pieces = T.plan_pieces(segments, [(0, a, b - a)])
    grads = T.KVGradients()
    kt, vt = T.release_kv(k, v, grads)
    out = T.tile_attention(q[:, :, a:b], kt, vt, pieces, 8**-0.5, grads)
    doc = torch.tensor([0] * 9 + [1] * 11)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(20, 20, dtype=torch.bool).tril()
    ref = tF.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed)
    torch.testing.assert_close(out, ref[:, :, a:b])
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref[:, :, a:b], (q, k, v), dout)
    for x, want in zip(got, ref_grads, strict=True):
        torch.testing.assert_close(x, want, rtol=0, atol=1e-6)  # the stand-in's LSE is float32, like flash-attn's
    calls = [c for _, c in F.PRIVATE_CALLS]
    assert len(calls) == 6  # three pieces, forward and backward
    span = k.untyped_storage().nbytes()
    assert all(k.data_ptr() <= c["k_ptr"] < k.data_ptr() + span for c in calls)  # views of K, not copies

"""flash-attn's kernels as block kernels, on CPU: its private functions as real `torch.library.custom_op`
stand-ins (`tests/_flash_standin.py`), their detection, the dispatch and its log, and the varlen path for packed
documents (segments, never a dense mask). torch's own CUDA kernels: tests/unit/test_lse_contracts.py."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from hf_longctx.attention.lse import choose as L
from hf_longctx.attention.lse import flash_attn as C
from hf_longctx.attention.lse.cpu import CpuFlashKernel, MathKernel
from hf_longctx.attention.lse.merge import merge_block
from hf_longctx.attention.ring.plan import VisibilityRule, plan_block, plan_ring
from hf_longctx.attention.ring.virtual import virtual_ring
from hf_longctx.data.layout import layout_indices
from tests import _flash_standin as F


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """A new process as far as kernel selection goes: no cached probe, nothing logged yet."""
    L._cuda.cache_clear()
    monkeypatch.setattr(L, "_LOGGED", set())
    yield
    L._cuda.cache_clear()


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
    ref_out, ref_lse = MathKernel().forward(q, k, v, causal=True, allowed=None, scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=0, atol=1e-6)
    grads = dense.backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3)
    for got, want in zip(
        grads,
        MathKernel().backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3),
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
    bf16, cuda = torch.bfloat16, L._cuda()

    def name(dtype, **kw):
        return L.choose_kernel("cuda", dtype, kernels=cuda, **{"masked": False, **kw}).name

    assert name(bf16) == name(bf16) == "flash_attn_2"
    assert name(bf16, masked=True, varlen=True) == "flash_attn_2_varlen"
    assert name(bf16, masked=True) == "cuda_efficient"  # window tiles
    assert name(torch.float32, masked=True, varlen=True) == "cuda_efficient_segments"
    assert name(bf16, masked=True, varlen=True, head_dims=(192, 128)) == "cuda_efficient_segments"
    lines = [r.getMessage() for r in caplog.records if "blocks use" in r.getMessage()]
    assert (
        lines.count("block attention: cuda torch.bfloat16 dense (head sizes 64/64) blocks use the flash_attn_2 kernel")
        == 1
    )
    assert (
        "block attention: cuda torch.bfloat16 packed (head sizes 64/64) blocks use the flash_attn_2_varlen kernel"
        in lines
    )
    assert len(lines) == 5  # one per (device, dtype, block kind, head sizes)
    assert any("flash-attn probe: flash_attn_2" in r.getMessage() for r in caplog.records)


def test_fa3_custom_ops_are_detected_for_dense_and_varlen_blocks(monkeypatch, fresh_dispatch):
    F.install_fa3(monkeypatch)
    dense, varlen, found = C.detect_flash_attn()
    assert dense.name == "flash_attn_3" and varlen.name == "flash_attn_3_varlen" and "flash_attn_interface" in found
    q, k, v, dout = _qkv(n=5, m=5)
    ref_out, ref_lse = MathKernel().forward(q, k, v, causal=True, allowed=None, scale=0.3)
    out, lse = dense.forward(q, k, v, causal=True, allowed=None, scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    grads = dense.backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3)
    want = MathKernel().backward(dout, q, k, v, ref_out, ref_lse, causal=True, allowed=None, scale=0.3)
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    doc = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    (plan,) = plan_block(torch.arange(5), torch.arange(5), VisibilityRule(doc))
    out, _ = varlen.forward(q, k, v, causal=False, allowed=None, scale=0.3, segments=plan.segments)
    ref_out, _ = MathKernel().forward(q, k, v, causal=False, allowed=plan.mask(2), scale=0.3)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    assert [c for name, c in F.PRIVATE_CALLS if name.startswith("fa3")] == [
        {"causal": True, "varlen": False},
        {"is_causal": True, "varlen": False},
        {"causal": True, "varlen": True},
    ]


def test_old_flash_attn_is_refused_with_a_reason_and_blocks_use_torchs_flash(monkeypatch, fresh_dispatch):
    F.install_private(monkeypatch, version="2.6.3")
    dense, varlen, found = C.detect_flash_attn()
    assert dense is None and varlen is None and "older than 2.7.0" in found
    cuda = L.cuda_kernels()
    assert L.choose_kernel("cuda", torch.float16, masked=False, kernels=cuda).name == "torch_flash"
    assert L.choose_kernel("cuda", torch.float16, masked=True, varlen=True, kernels=cuda).name == "torch_flash_varlen"


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
    plans = [p for r in range(2) for parts in plan_ring(indices, r, rule) for p in parts]
    assert any(p.segments is not None for p in plans)
    assert all(p.allowed is None for p in plans)
    for p in plans:
        if p.segments is not None:
            assert p.segments.cu_q.dtype == torch.int32 and isinstance(p.segments.max_q, int)


@pytest.mark.parametrize("world", [2, 4])
def test_varlen_path_matches_float64_attention_over_packed_documents(monkeypatch, world):
    F.install_private(monkeypatch)
    _, varlen, _ = C.detect_flash_attn()
    seq = 48
    rule = _packed_rule(seq, [(10, 1, 23, 14), (3, 45)])
    q, k, v, dout = _qkv(n=seq, m=seq, seed=world)
    used = []

    def kernel_for(q, plan):
        used.append(plan.segments is not None)
        return varlen if plan.segments is not None else CpuFlashKernel()

    got = virtual_ring(q, k, v, dout, world, "zigzag", rule, 0.35, kernel_for)
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


@pytest.mark.parametrize("empty", [-math.inf, math.inf])  # +inf: FlashAttention-2's mark of a row without keys
def test_merge_ignores_a_nan_output_on_rows_whose_block_lse_is_infinite(empty):
    out = torch.zeros(1, 1, 2, 3, dtype=torch.float64)
    lse = torch.full((1, 1, 2), -math.inf, dtype=torch.float64)
    merge_block(
        out, lse, torch.ones(1, 1, 2, 3, dtype=torch.float64), torch.zeros(1, 1, 2, dtype=torch.float64), slice(0, 2)
    )
    nan_row = torch.tensor([[[[1.0] * 3, [math.nan] * 3]]], dtype=torch.float64)
    merge_block(out, lse, nan_row, torch.tensor([[[0.0, empty]]], dtype=torch.float64), slice(0, 2))
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out, torch.ones_like(out))
    torch.testing.assert_close(lse, torch.tensor([[[math.log(2.0), 0.0]]], dtype=torch.float64))


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

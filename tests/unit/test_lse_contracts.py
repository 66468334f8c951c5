"""The CUDA block kernels (`attention/lse/`) on CPU stand-ins that enforce the real ops' contracts.

One test per failure class the first H200 run found (2026-12-04: the ring's block kernels passed 9 of 28 GPU tests,
tile attention 0 of 6), each failing on that day's adapters, plus the stand-ins' own checks: a stand-in that accepts
what the real kernel refuses would let these pass on CPU and fail on a GPU again.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_longctx.attention.lse import choose as K
from hf_longctx.attention.lse.cpu import CpuFlashKernel, MathKernel
from hf_longctx.attention.lse.efficient import EfficientKernel, bmhk_out, padded_lse
from hf_longctx.attention.lse.loop import segment_loop
from hf_longctx.attention.lse.torch_flash import TorchFlashKernel, torch_flash_varlen
from hf_longctx.attention.ring.plan import VisibilityRule, plan_block
from hf_longctx.attention.ring.virtual import reference, virtual_ring
from tests._cuda_standins import AtenOps, EfficientOps, FlashOps, raw_read

BF16 = torch.bfloat16


def _qkv(bs=2, h=4, hkv=2, n=37, m=37, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bs, h, n, d, generator=g).to(dtype)
    k, v = (torch.randn(bs, hkv, m, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(bs, h, n, d, generator=g).to(dtype)


def _close(got, want, rel, name=""):
    assert not bool(torch.isnan(got).any()), f"{name}: NaN"
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * want.double().abs().max().item(), (name, err, want.abs().max().item())


def _stand_in_kernels(ops=None):
    return K.cuda_kernels(ops or AtenOps(), flash_attn=False)


# ---- failure class 1: the efficient backward's LSE stride / alignment ("LSE is not correctly aligned (strideH)")


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows", [37, 40, 64])
def test_efficient_backward_gets_the_lse_in_its_forwards_padded_layout(dtype, rows):
    """Any query block length: the merged LSE goes back padded to 32 rows with +inf, as the forward returns it."""
    ops = AtenOps()
    kernel = EfficientKernel(ops)
    q, k, v, dout = _qkv(n=rows, m=rows, dtype=dtype)
    out, lse = kernel.forward(q, k, v, causal=True, allowed=None, scale=0.3)
    ref_out, ref_lse = MathKernel().forward(q.double(), k.double(), v.double(), causal=True, allowed=None, scale=0.3)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    _close(out, ref_out, tol, "out")
    assert lse.shape == (2, 4, rows) and lse.is_contiguous()
    grads = kernel.backward(dout, q, k, v, out, lse, causal=True, allowed=None, scale=0.3)
    want = MathKernel().backward(
        dout.double(), q.double(), k.double(), v.double(), out.double(), lse.double(), causal=True, allowed=None,
        scale=0.3,
    )  # fmt: skip
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        _close(got, ref, tol, name)
    (_, call), *_ = [c for c in ops.calls if c[0] == "efficient_backward"]
    assert call["lse"] == (2, 4, -(-rows // 32) * 32)


def test_padded_lse_and_bmhk_out_give_the_layouts_the_efficient_backward_reads():
    lse = torch.randn(2, 3, 40)[:, :, 3:40]  # a strided slice of a merged LSE, 37 rows
    padded = padded_lse(lse)
    assert padded.shape == (2, 3, 64) and padded.stride() == (192, 64, 1)
    assert torch.equal(padded[..., :37], lse) and bool((padded[..., 37:] == math.inf).all())
    out = torch.randn(2, 3, 37, 8)  # contiguous as [B, H, M, K]: the layout read wrong
    fixed = bmhk_out(out)
    assert torch.equal(fixed, out) and fixed.transpose(1, 2).is_contiguous()
    assert bmhk_out(fixed).data_ptr() == fixed.data_ptr()  # already [B, M, H, K]-dense: no copy


# ---- failure class 2: rows that see no key in a block


def _kernels_under_test():
    ops = AtenOps()
    return [(CpuFlashKernel(), torch.float32), (MathKernel(), torch.float32), (EfficientKernel(ops), torch.float32),
            (EfficientKernel(ops), BF16)]  # fmt: skip


@pytest.mark.parametrize("index", range(4))
def test_every_mask_kernel_gives_rows_without_keys_out_zero_and_lse_minus_inf(index):
    kernel, dtype = _kernels_under_test()[index]
    q, k, v, _ = _qkv(n=6, m=8, dtype=dtype)
    allowed = torch.rand(2, 1, 6, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[0, 0, 2] = False  # row 2 of batch 0 sees no key
    allowed[1, 0, 5] = False
    allowed[0, 0, 0, 0] = allowed[1, 0, 0, 0] = True
    out, lse = kernel.forward(q, k, v, causal=False, allowed=allowed, scale=0.5)
    for b, row in ((0, 2), (1, 5)):
        assert bool((out[b, :, row] == 0).all()) and bool((lse[b, :, row] == -math.inf).all()), kernel.name
    assert bool(torch.isfinite(lse[0, :, 0]).all())


def test_varlen_kernels_never_compute_a_row_without_keys():
    # Queries at 8..11, keys at 0..7: row 1's document 1 spans 6..8, so its query at 9 sees no key of this block.
    doc = torch.tensor([[0] * 6 + [1] * 4 + [2] * 2, [0] * 6 + [1] * 3 + [2] * 3])
    (plan,) = plan_block(torch.arange(8, 12), torch.arange(0, 8), VisibilityRule(doc))
    assert plan.segments is not None
    ops = AtenOps()
    q, k, v, _ = _qkv(n=4, m=8, dtype=BF16)
    out, lse = torch_flash_varlen(ops).forward(
        q[:, :, plan.rows], k[:, :, plan.cols], v[:, :, plan.cols], causal=False, allowed=None, scale=0.5,
        segments=plan.segments,
    )  # fmt: skip
    assert bool((out[1, :, 1] == 0).all()) and bool((lse[1, :, 1] == -math.inf).all())
    assert bool(torch.isfinite(lse[0]).all())
    assert plan.segments.cu_q.tolist() == [0, 2, 3]  # the empty row never reaches the kernel


# ---- failure classes 3 and 4: ring values (packed, world 4) and NaN (causal, world 8) in fp16/bf16


def _rule(kind: str, seq: int) -> VisibilityRule:
    rows = [(100, 1, seq - 301, 200), (50, seq - 212, 162)]
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows])
    docs = None if kind in ("causal", "window") else doc
    return VisibilityRule(docs, window=37 if kind in ("packed_window", "window") else None)


def _ring_case(kind, world, dtype, kernel_for, seq=512):
    q, k, v, dout = _qkv(bs=2, h=4, hkv=2, n=seq, m=seq, d=16, dtype=dtype, seed=world)
    rule = _rule(kind, seq)
    pos = torch.arange(seq)
    want = reference(q, k, v, dout, rule.allowed(pos, pos)[:, None], 0.25)
    got = virtual_ring(q, k, v, dout, world, "zigzag", rule, 0.25, kernel_for)
    # bf16 inputs, float64 stand-ins: what is left is each block's bf16 output and gradients (a key's gradient is
    # the sum of up to `world` rounded pieces). A misread `out` or LSE is off by O(1) (1.40 of 2.8 on the H200).
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        _close(a, b, 2e-2 if dtype != torch.float32 else 1e-6, f"{kind} world {world} {name}")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("kind", ["causal", "packed", "packed_window", "window"])
def test_ring_blocks_on_the_cuda_kernels_match_float64_in_bf16(kind, world):
    """What `select_kernel` picks on CUDA without flash-attn (torch's flash for dense and packed blocks, the
    efficient kernel for masks), every rank of a zigzag ring, against float64 autograd. Two rows: a window over
    one document per row plans one mask for the whole batch, which the efficient kernel takes only at batch size."""
    kernels, used = _stand_in_kernels(), set()

    def kernel_for(q, plan):
        kernel = K.choose_kernel("cuda", q.dtype, masked=plan.masked, varlen=plan.segments is not None,
                                 head_dims=(16, 16), kernels=kernels)  # fmt: skip
        used.add(kernel.name)
        return kernel

    _ring_case(kind, world, BF16, kernel_for)
    assert ("cuda_efficient" in used) == kind.endswith("window")  # dense and packed blocks run on flash


@pytest.mark.parametrize("kind", ["causal", "packed"])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_ring_blocks_on_the_efficient_kernel_match_float64_at_world_8(kind, dtype):
    """Every block on the memory-efficient kernel (packed blocks segment by segment): in bf16 it reads `out` at its
    own fixed row stride (the NaN at world 8 on the H200 was that read running past the end of a [B, H, M,
    K]-contiguous `out`)."""
    kernel = EfficientKernel(AtenOps())
    packed = segment_loop(kernel)
    _ring_case(kind, 8, dtype, lambda q, plan: packed if plan.segments is not None else kernel)


# ---- the tiled layer's attention on the same kernels


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_tile_attention_on_the_cuda_kernels_matches_float64(monkeypatch, dtype):
    """Odd tile and document lengths (511 tokens, 5 tiles): torch's flash kernel in bf16, the efficient one in fp32."""
    from hf_longctx.memory import tile_attention as T

    kernels = _stand_in_kernels()
    picked = K.choose_kernel("cuda", dtype, masked=False, head_dims=(16, 16), kernels=kernels)
    assert picked.name == ("torch_flash" if dtype == BF16 else "cuda_efficient")
    monkeypatch.setattr(T, "_kernel", lambda q, v: picked)
    seq, lengths = 511, (300, 17, 194)
    q, k, v, dout = _qkv(bs=1, h=4, hkv=2, n=seq, m=seq, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    segments = [[(0, 300), (300, 317), (317, 511)]]
    grads = T.KVGradients()
    kt, vt = T.release_kv(k, v, grads)
    bounds = torch.linspace(0, seq, 6).long().tolist()
    out = torch.cat([T.tile_attention(q[:, :, a:b], kt, vt, T.plan_pieces(segments, [(0, a, b - a)]), 0.25, grads)
                     for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=2)  # fmt: skip
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, reference(q, k, v, dout, allowed, 0.25), strict=True):
        _close(a.detach(), b, 2e-2 if dtype == BF16 else 1e-6, name)


# ---- the kernel choice


def test_choose_kernel_on_cuda_without_flash_attn():
    kernels = _stand_in_kernels()

    def name(dtype, **kw):
        return K.choose_kernel("cuda", dtype, kernels=kernels, **{"masked": False, **kw}).name

    assert name(BF16) == name(torch.float16) == "torch_flash"
    assert name(BF16, masked=True, varlen=True) == "torch_flash_varlen"
    assert name(BF16, masked=True) == "cuda_efficient"  # sliding-window tiles
    assert name(torch.float32) == "cuda_efficient"
    assert name(torch.float32, masked=True, varlen=True) == "cuda_efficient_segments"  # packed: per segment, no mask
    assert name(BF16, head_dims=(192, 128)) == "cuda_efficient"  # MLA: flash wants one head size
    assert name(BF16, head_dims=(264, 264)) == "cuda_efficient"  # over flash's 256
    assert name(BF16, head_dims=(6, 6)) == "math"  # no kernel takes it
    assert name(BF16, head_dims=(36, 36)) == "math"  # half precision: the efficient kernel wants 8-element rows
    assert name(torch.float32, head_dims=(36, 36)) == "cuda_efficient"  # fp32: 4 elements
    assert name(torch.float64) == "math"
    assert K.choose_kernel("cpu", BF16, masked=True).name == "cpu_flash"


# ---- the stand-ins refuse what the kernels refuse and read what the kernels read


def test_flash_stand_in_enforces_flash_api_checks():
    ops = FlashOps()
    q, k, v, _ = _qkv(bs=1, n=8, m=8, d=16, dtype=BF16)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    with pytest.raises(AssertionError, match="fp16 and bf16"):
        ops._flash_attention_forward(qt.float(), kt.float(), vt.float(), None, None, 8, 8, 0.0, False, False)
    with pytest.raises(AssertionError, match="contiguous last dimension"):
        ops._flash_attention_forward(qt.transpose(-1, -2), kt, vt, None, None, 8, 8, 0.0, False, False)
    with pytest.raises(AssertionError, match="multiple of 8"):
        ops._flash_attention_forward(qt[..., :12], kt[..., :12], vt[..., :12], None, None, 8, 8, 0.0, False, False)
    cu = torch.tensor([0, 8], dtype=torch.int64)
    with pytest.raises(AssertionError, match="int32"):
        ops._flash_attention_forward(qt[0], kt[0], vt[0], cu, cu, 8, 8, 0.0, False, False)


def test_flash_stand_in_reads_a_strided_lse_the_way_the_kernel_does():
    """FA's backward indexes softmax_lse's data pointer as contiguous: a transposed LSE is read silently wrong."""
    ops = FlashOps()
    q, k, v, dout = (t.transpose(1, 2) for t in _qkv(bs=1, n=8, m=8, d=16, dtype=BF16))
    out, lse, *_ = ops._flash_attention_forward(q, k, v, None, None, 8, 8, 0.0, True, False, scale=0.3)
    args = (None, None, 8, 8, 0.0, True, None, None)
    right = ops._flash_attention_backward(dout, q, k, v, out, lse, *args, scale=0.3)
    strided = lse.transpose(1, 2).contiguous().transpose(1, 2)  # same values, heads innermost in memory
    wrong = ops._flash_attention_backward(dout, q, k, v, out, strided, *args, scale=0.3)
    assert not torch.equal(right[0], wrong[0])
    assert torch.equal(raw_read(strided, (1, 4, 8), (32, 8, 1)), strided.transpose(1, 2).reshape(1, 4, 8).double())


def test_efficient_stand_in_enforces_check_supported_and_reads_out_at_its_fixed_row_stride():
    ops = EfficientOps()
    q, k, v, dout = _qkv(bs=2, h=4, hkv=4, n=37, m=37, dtype=BF16)
    out, lse, seed, offset = ops._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=0.3)
    assert lse.shape == (2, 4, 64) and bool((lse[..., 37:] == math.inf).all())
    assert out.transpose(1, 2).is_contiguous()  # written as [B, M, H, K]
    args = (seed, offset, 0.0, [True, True, True, False], False)
    with pytest.raises(AssertionError, match=r"LSE is not correctly aligned \(strideH\)"):
        ops._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse[..., :37].contiguous(), *args, scale=0.3
        )
    with pytest.raises(AssertionError, match="no GQA"):
        ops._scaled_dot_product_efficient_attention(q, k[:, :2], v[:, :2], None, True, 0.0, False)
    one_row_bias = torch.zeros(1, 4, 37, 37, dtype=BF16)
    with pytest.raises(AssertionError, match=r"wrong shape \(batch dimension\)"):  # no broadcast over the batch
        ops._scaled_dot_product_efficient_attention(q, k, v, one_row_bias, True, 0.0, False)
    q36, k36, v36, _ = _qkv(bs=2, h=4, hkv=4, n=37, m=37, d=36, dtype=BF16)  # rows of 72 bytes: not 128-bit aligned
    with pytest.raises(AssertionError, match="not correctly aligned"):
        ops._scaled_dot_product_efficient_attention(q36, k36, v36, None, True, 0.0, False)
    ops._scaled_dot_product_efficient_attention(q36.float(), k36.float(), v36.float(), None, True, 0.0, False)
    right = ops._scaled_dot_product_efficient_attention_backward(dout, q, k, v, None, out, lse, *args, scale=0.3)
    as_bhmk = out.contiguous()  # the same values, contiguous as [B, H, M, K]
    misread = ops._scaled_dot_product_efficient_attention_backward(dout, q, k, v, None, as_bhmk, lse, *args, scale=0.3)
    assert bool(torch.isnan(misread[0]).any()) or not torch.allclose(misread[0].float(), right[0].float())
    fp32 = [t.float() for t in (q, k, v, dout)]
    out32, lse32, *_ = ops._scaled_dot_product_efficient_attention(*fp32[:3], None, True, 0.0, False, scale=0.3)
    a = ops._scaled_dot_product_efficient_attention_backward(fp32[3], *fp32[:3], None, out32, lse32, *args, scale=0.3)
    b = ops._scaled_dot_product_efficient_attention_backward(
        fp32[3], *fp32[:3], None, out32.contiguous(), lse32, *args, scale=0.3
    )
    assert torch.equal(a[0], b[0])  # fp32: aten computes rowsum(dO * O) from out's real strides


def test_stand_in_kernels_report_the_stand_in_names():
    """The stand-in kernels are the library's adapters over stand-in ops (not re-implementations)."""
    kernels = _stand_in_kernels()
    assert isinstance(kernels.dense, TorchFlashKernel) and isinstance(kernels.masked, EfficientKernel)
    assert kernels.varlen.name == "torch_flash_varlen"

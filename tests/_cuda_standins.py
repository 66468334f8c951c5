"""CPU stand-ins for torch's CUDA attention ops that the block kernels' adapters call (`attention/lse/`).

`FlashOps`: `aten._flash_attention_forward` / `_flash_attention_backward` (torch's FlashAttention-2).
`EfficientOps`: `aten._scaled_dot_product_efficient_attention` and its backward (the CUTLASS memory-efficient kernel).

A stand-in that accepts what the real kernel refuses, or reads its inputs more kindly than the kernel does, lets a
CPU test pass code that fails on a GPU (the H200 run of 2026-12-04 found three such defects). So each one refuses
what the real op refuses (every check names its source in torch) and reads memory the way the real kernel does:
the flash backward's LSE through its data pointer as a contiguous tensor; the efficient backward's LSE through its
strides up to its 32-row padding, and, in fp16/bf16, its `out` with the kernel's fixed row stride. Memory past a
tensor's storage reads as NaN (on a GPU: whatever lies there). Values are computed in float64; every call is
recorded in `calls`.

Sources: aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp (FA), mem_eff_attention/kernel_forward.h
(KF), mem_eff_attention/kernel_backward.h (KB), attention.cu / attention_backward.cu (AC / AB), torch 2.10-2.13.
"""

from __future__ import annotations

import math

import torch

HALF = (torch.float16, torch.bfloat16)


def min_alignment(dtype: torch.dtype) -> int:
    """Elements of pointer / stride alignment on sm80+: the half-precision kernels are all `kAligned` (cutlassF.h /
    cutlassB.h list no other for sm80), whose `kAlignmentQ` is 128 bits (8 elements); fp32's is 4 (KF/KB
    check_supported)."""
    return 16 // dtype.itemsize


def raw_read(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
    """What a kernel reading `t`'s memory from `t.data_ptr()` with `size` / `stride` sees (float64); elements past the
    end of `t`'s storage read as NaN."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    flat.set_(storage, 0, (storage.nbytes() // t.element_size(),))
    flat = flat.double()
    need = t.storage_offset() + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    if need > flat.numel():
        flat = torch.cat([flat, torch.full((need - flat.numel(),), math.nan, dtype=flat.dtype)])
    return flat.as_strided(size, stride, t.storage_offset())


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _attention(q, k, v, scale, allowed):
    """float64 softmax attention of one segment: q [sq, h, d], k/v [sk, hk, d], allowed [sq, sk] or [h, sq, sk]."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(g, 1)), lse


def _grads(dout, q, k, v, out, lse, scale, allowed):
    """float64 flash backward of one segment from the given (global) out and LSE: (dq, dk, dv)."""
    g = q.shape[1] // k.shape[1]
    kx, vx = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kx) * scale
    p = torch.exp(s.masked_fill(~allowed, -math.inf) - lse[..., None])
    do = dout.double()
    dp = torch.einsum("qhd,khd->hqk", do, vx)
    ds = p * (dp - (do * out.double()).sum(-1).transpose(0, 1)[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kx) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.double()) * scale
    dv = torch.einsum("hqk,qhd->khd", p, do)
    return dq, dk.unflatten(1, (k.shape[1], g)).sum(2), dv.unflatten(1, (k.shape[1], g)).sum(2)


def _bottom_right(sq: int, sk: int, causal: bool) -> torch.Tensor:
    """FA2's causal mask when sq != sk is aligned bottom-right (FA `mha_fwd`; sdp_utils.cpp says so too)."""
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    return allowed.tril(sk - sq) if causal else allowed


class FlashOps:
    """`aten._flash_attention_forward` / `_flash_attention_backward`, dense `[B, S, H, D]` or varlen `[T, H, D]`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    @staticmethod
    def _check_flash(q, k, v, cu_q, cu_k, max_q, max_k) -> list[tuple[int, int, int, int]]:
        assert q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type"  # FA mha_fwd
        assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype"  # FA
        for name, t in (("query", q), ("key", k), ("value", v)):
            assert t.stride(-1) == 1, f"{name}: Input tensor must have contiguous last dimension"  # FA CHECK
        d = q.shape[-1]
        assert d % 8 == 0 and d <= 256, f"head size {d}: a multiple of 8 up to 256 (FA: padded only by SDPA)"
        assert k.shape[-1] == d and v.shape[-1] == d, "key/value head size must equal the query's (FA CHECK_SHAPE)"
        assert q.shape[-2] % k.shape[-2] == 0, "Number of heads in key/value must divide number of heads in query"
        assert isinstance(max_q, int) and isinstance(max_k, int), "max_seqlen_q/k are ints (SymInt)"
        if cu_q is None:  # dense
            assert q.dim() == 4 and k.shape[:2] == v.shape[:2] and k.shape[0] == q.shape[0], "dense [B, S, H, D]"
            return [
                (b * q.shape[1], (b + 1) * q.shape[1], b * k.shape[1], (b + 1) * k.shape[1]) for b in range(q.shape[0])
            ]
        assert q.dim() == 3 and k.dim() == 3, "varlen [T, H, D]"
        bounds = []
        for cu, total, longest in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
            assert cu.dtype == torch.int32, "cu_seqlens_q must have dtype int32"  # FA mha_varlen_fwd
            assert cu.is_contiguous() and cu.device == q.device, "cu_seqlens must be contiguous, on q's device"
            b = cu.tolist()
            lengths = [y - x for x, y in zip(b[:-1], b[1:], strict=True)]
            assert b[0] == 0 and b[-1] == total and min(lengths) >= 0, b
            assert max(lengths) <= longest, "max_seqlen smaller than a segment"
            bounds.append(b)
        assert len(bounds[0]) == len(bounds[1]), "CHECK_SHAPE(cu_seqlens_k, batch_size + 1)"
        return list(zip(bounds[0][:-1], bounds[0][1:], bounds[1][:-1], bounds[1][1:], strict=True))

    @staticmethod
    def _flat(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, *t.shape[-2:]) if t.dim() == 4 else t

    def _flash_attention_forward(
        self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
        *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
        block_table=None, num_splits=None,
    ):  # fmt: skip
        assert dropout_p == 0.0 and not return_debug_mask and window_size_left in (None, -1)
        segs = self._check_flash(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
        self.calls.append(("flash_forward", {"causal": is_causal, "varlen": cum_seq_q is not None}))
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        q, k, v = self._flat(query), self._flat(key), self._flat(value)
        out = torch.zeros(q.shape, dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), math.inf)  # [H, T]; empty segments: +inf (FA max_seqlen_k == 0)
        for a, b, c, d in segs:
            o, s = _attention(q[a:b], k[c:d], v[c:d], scale, _bottom_right(b - a, d - c, is_causal))
            out[a:b], lse[:, a:b] = o, s
        if cum_seq_q is None:  # dense: [B, H, Sq]
            bsz, sq, h = query.shape[:3]
            lse = lse.view(h, bsz, sq).transpose(0, 1)
        u64 = torch.empty((), dtype=torch.uint64)
        return (
            out.to(query.dtype).view(query.shape),
            lse.float().contiguous(),
            torch.zeros(2, dtype=torch.uint64),
            u64,
            u64,
        )

    def _flash_attention_backward(
        self, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
        philox_seed, philox_offset, *, scale=None, window_size_left=None, window_size_right=None,
    ):  # fmt: skip
        assert dropout_p == 0.0 and window_size_left in (None, -1)
        segs = self._check_flash(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k)
        # AB `_flash_attention_backward` makes grad_out and out contiguous; FA `mha_bwd` then checks last dims.
        assert grad_out.shape == out.shape == query.shape[:-1] + value.shape[-1:]
        assert logsumexp.dtype == torch.float32, "the kernel reads softmax_lse as float*"
        self.calls.append(("flash_backward", {"causal": is_causal, "lse": tuple(logsumexp.shape)}))
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        q, k, v = self._flat(query), self._flat(key), self._flat(value)
        dout, o = self._flat(grad_out.contiguous()), self._flat(out.contiguous())
        h, total = q.shape[1], q.shape[0]
        # FA checks nothing of softmax_lse but its device and indexes its data pointer as contiguous [B, H, Sq]
        # (dense) or [H, T] (varlen): `row_offset_lse` in flash_bwd_kernel.h.
        if cum_seq_q is None:
            bsz, sq = query.shape[:2]
            lse = raw_read(logsumexp, (bsz, h, sq), _contiguous_strides((bsz, h, sq))).transpose(0, 1).reshape(h, -1)
        else:
            lse = raw_read(logsumexp, (h, total), (total, 1))
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (q, k, v))
        for a, b, c, d in segs:
            grads = _grads(dout[a:b], q[a:b], k[c:d], v[c:d], o[a:b], lse[:, a:b], scale,
                           _bottom_right(b - a, d - c, is_causal))  # fmt: skip
            dq[a:b] += grads[0]
            dk[c:d] += grads[1]
            dv[c:d] += grads[2]
        return tuple(g.to(t.dtype).view(t.shape) for g, t in zip((dq, dk, dv), (query, key, value), strict=True))


class EfficientOps:
    """`aten._scaled_dot_product_efficient_attention` and its backward: `[B, H, M, K]` in, read as `[B, M, H, K]`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    @staticmethod
    def _check_efficient(query, key, value, bias, pointers: tuple = ()) -> None:
        # Read through `.transpose(1, 2)` (AC/AB): strides below are the [B, M, H, K] view's. KF/KB check_supported.
        assert query.dtype == key.dtype == value.dtype, "query, key and value must have the same dtype"
        assert query.shape[1] == key.shape[1] == value.shape[1], "no GQA: query.size(2) == key.size(2) (AB)"
        align = min_alignment(query.dtype)
        for name, t in (("query", query), ("key", key), ("value", value), *pointers):
            assert t.data_ptr() % (align * t.element_size()) == 0, f"{name}_ptr is not correctly aligned"
        for name, t in (("query", query), ("key", key), ("value", value)):
            bmhk = t.transpose(1, 2)
            assert bmhk.stride(-1) == 1, f"{name}: last dimension must be contiguous"
            for dim, label in ((1, "strideM"), (2, "strideH"), (0, "strideB")):
                if bmhk.shape[dim] > 1 or dim == 1:
                    assert bmhk.stride(dim) % align == 0, f"{name} is not correctly aligned ({label})"
        if bias is not None:
            assert bias.dtype == query.dtype, "invalid dtype for bias - should match query's dtype"  # AC
            assert bias.dim() == 4, "Bias expected in BMHK format"  # AC
            want = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            for dim, label in enumerate(("batch", "head", "seqlenQ", "seqlenKV")):
                assert bias.shape[dim] == want[dim], f"attn_bias: wrong shape ({label} dimension)"  # AC: no broadcast
            assert bias.stride(-1) == 1 and bias.data_ptr() % (align * bias.element_size()) == 0
            for dim, label in ((0, "strideB"), (1, "strideH"), (2, "strideM")):
                if bias.shape[dim] > 1:
                    assert bias.stride(dim) % align == 0, f"attn_bias is not correctly aligned ({label})"

    @staticmethod
    def _allowed(bias, b, causal, m, n) -> torch.Tensor:
        allowed = torch.ones(m, n, dtype=torch.bool)
        if causal:  # CausalFromTopLeft (SDPA's is_causal)
            allowed = allowed.tril()
        if bias is not None:
            allowed = allowed & ~torch.isinf(bias[b].double())  # [H, M, N]: the 0 / -inf bias the adapters build
        return allowed

    def _scaled_dot_product_efficient_attention(
        self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None
    ):
        assert compute_log_sumexp and dropout_p == 0.0
        self._check_efficient(query, key, value, attn_bias)
        self.calls.append(("efficient_forward", {"causal": is_causal, "bias": attn_bias is not None}))
        bsz, h, m, kv = *query.shape[:3], value.shape[-1]
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        out = torch.zeros(bsz, m, h, kv, dtype=query.dtype)  # the kernel writes [B, M, H, K]
        lse = torch.full((bsz, h, -(-m // 32) * 32), math.inf, dtype=torch.float32)  # KF: padded with inf
        for b in range(bsz):
            o, s = _attention(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1), scale,
                              self._allowed(attn_bias, b, is_causal, m, key.shape[2]))  # fmt: skip
            empty = s == -math.inf  # KF: fully masked rows get LSE 0 and out 0
            out[b] = o.masked_fill(empty.transpose(0, 1)[..., None], 0.0).to(query.dtype)
            lse[b, :, :m] = s.masked_fill(empty, 0.0).float()
        seed = offset = torch.empty((), dtype=torch.int64)
        return out.transpose(1, 2), lse, seed, offset

    def _scaled_dot_product_efficient_attention_backward(
        self, grad_out, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
        grad_input_mask, is_causal=False, *, scale=None,
    ):  # fmt: skip
        assert dropout_p == 0.0 and not grad_input_mask[3]
        grad_out = grad_out.transpose(1, 2).contiguous().transpose(1, 2)  # AB: grad_out made contiguous
        self._check_efficient(query, key, value, attn_bias, (("output", out), ("grad_output", grad_out)))
        bsz, h, m, kv = *query.shape[:3], value.shape[-1]
        n = key.shape[2]
        assert logsumexp.dtype == torch.float32, "logsumexp is float"
        assert logsumexp.stride(-1) == 1 or m == 1, "the kernel steps along the LSE's last dimension by 1"
        assert h <= 1 or logsumexp.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)"  # KB check_supported
        assert bsz <= 1 or logsumexp.stride(0) % 8 == 0, "LSE is not correctly aligned (strideB)"  # KB
        self.calls.append(("efficient_backward", {"causal": is_causal, "lse": tuple(logsumexp.shape)}))
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        padded = -(-m // 32) * 32
        # KB reads the LSE through its strides up to the next multiple of 32 rows (accumApplyLSEToSmem).
        lse = raw_read(logsumexp, (bsz, h, padded), (logsumexp.stride(0), logsumexp.stride(1), 1))
        # fp16/bf16: KB computes rowsum(dO * O) itself, reading `out` at row stride head_dim_value * num_heads
        # (`o_strideM()`), batch and head strides from the tensor; fp32: AB computes it from `out` as it is.
        if query.dtype in HALF:
            o = raw_read(out, (bsz, m, h, kv), (out.stride(0), h * kv, out.stride(1), 1))
        else:
            o = out.transpose(1, 2).double()
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64) for t in (query, key, value))
        for b in range(bsz):
            allowed = self._allowed(attn_bias, b, is_causal, m, n)
            qb, kb, vb = (t[b].transpose(0, 1) for t in (query, key, value))
            grads = _grads(grad_out[b].transpose(0, 1), qb, kb, vb, o[b], lse[b, :, :m], scale, allowed)
            for dst, g in zip((dq, dk, dv), grads, strict=True):
                dst[b] = g.transpose(0, 1)
            # Rows m..padded of the last query block: zero q and dO, P = exp(-lse): a NaN or -inf there poisons
            # dK/dV (0 * inf), a +inf (the forward's padding) or finite value adds nothing.
            pad = lse[b, :, m:]
            if bool((torch.isnan(pad) | (pad == -math.inf)).any()):
                dk[b], dv[b] = math.nan, math.nan
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), torch.empty(0)


class AtenOps(FlashOps, EfficientOps):
    """Both stand-ins in one namespace, as the adapters find them in `torch.ops.aten`."""

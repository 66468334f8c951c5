"""A CPU stand-in for flash-attn, so the flash code path of transformers and of hf_longctx runs in CPU tests.

flash-attn needs a GPU; its Python API is what transformers' flash integration calls. The stand-in keeps
that API (flash-attn 2.8's `flash_attn_func` / `flash_attn_varlen_func`, plus the `s_aux` sink argument of
the FA3 kernels that GPT-OSS uses), asserts what the real kernels require of their inputs, and computes
plain softmax attention per segment in float64:

- `cu_seqlens_*` are int32 tensors on q's device, start at 0, end at the token count, never decrease;
- `max_seqlen_*` are Python ints equal to the longest segment (the real kernel sizes its grid with them);
- `causal` is a bool, `window_size` a pair of ints (-1 = unbounded), `softcap` a float (0 = off);
- q/k/v are `[tokens, heads, dim]` (varlen) or `[batch, seq, heads, dim]`, k/v heads divide q heads.

`install()` makes `attn_implementation="flash_attention_2"` resolve to it (process-wide: call it in test
workers, or through the `flash_standin` fixture).
"""

from __future__ import annotations

import math

import torch

from tests._cuda_standins import raw_read

IMPLEMENTATION = "flash_attention_2"
CALLS = {"varlen": 0, "dense": 0}


def _attend(q, k, v, scale, causal, window, softcap, sinks) -> torch.Tensor:
    """One segment: q `[sq, h, d]`, k/v `[sk, hk, d]` -> `[sq, h, d]` (bottom-right causal alignment)."""
    sq, h, _ = q.shape
    sk, hk, _ = k.shape
    assert h % hk == 0, (h, hk)
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qi = torch.arange(sq)[:, None] + (sk - sq)
    kj = torch.arange(sk)[None, :]
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        allowed &= kj <= qi
    left, right = window
    if left >= 0:
        allowed &= kj >= qi - left
    if right >= 0:
        allowed &= kj <= qi + right
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:  # a per-head logit that takes part in the softmax but has no value
        sink = sinks.double().view(h, 1, 1).expand(h, sq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs.nan_to_num(0.0), v.double())
    return out.to(q.dtype)


def _check_common(q, k, v, dropout_p, causal, window_size, softcap) -> None:
    assert q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.device == k.device == v.device
    assert dropout_p == 0.0, "the stand-in has no dropout"
    assert isinstance(causal, bool), type(causal)
    assert isinstance(window_size, tuple) and len(window_size) == 2, window_size
    assert all(isinstance(w, int) for w in window_size), window_size
    assert isinstance(softcap, float), type(softcap)


def _check_cu(cu: torch.Tensor, max_len: int, total: int, q: torch.Tensor) -> list[int]:
    assert cu.dtype == torch.int32, f"cu_seqlens must be int32, got {cu.dtype}"
    assert cu.device == q.device, (cu.device, q.device)
    assert isinstance(max_len, int) and not isinstance(max_len, bool), f"max_seqlen must be an int, got {type(max_len)}"
    bounds = cu.tolist()
    assert bounds[0] == 0 and bounds[-1] == total, (bounds[0], bounds[-1], total)
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert min(lengths) >= 0 and max(lengths) == max_len, (lengths, max_len)
    return bounds


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    s_aux=None,
):
    """flash-attn's varlen API: q `[total_q, h, d]`, k/v `[total_k, hk, d]`, segments from `cu_seqlens_*`."""
    _check_common(q, k, v, dropout_p, causal, window_size, softcap)
    assert alibi_slopes is None and block_table is None and not return_attn_probs
    bq = _check_cu(cu_seqlens_q, max_seqlen_q, q.shape[0], q)
    bk = _check_cu(cu_seqlens_k, max_seqlen_k, k.shape[0], q)
    assert len(bq) == len(bk)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    CALLS["varlen"] += 1
    parts = [
        _attend(q[a:b], k[c:d], v[c:d], scale, causal, window_size, softcap, s_aux)
        for a, b, c, d in zip(bq[:-1], bq[1:], bk[:-1], bk[1:], strict=True)
    ]
    return torch.cat(parts, dim=0)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    s_aux=None,
):
    """flash-attn's dense API: `[batch, seq, heads, dim]`, one segment per row."""
    _check_common(q, k, v, dropout_p, causal, window_size, softcap)
    assert alibi_slopes is None and not return_attn_probs
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    CALLS["dense"] += 1
    return torch.stack(
        [_attend(q[b], k[b], v[b], scale, causal, window_size, softcap, s_aux) for b in range(q.shape[0])]
    )


def install() -> None:
    """Route transformers' "flash_attention_2" to the stand-in in this process (idempotent)."""
    from transformers import modeling_flash_attention_utils as fa

    def lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        assert implementation == IMPLEMENTATION, implementation
        return flash_attn_func, flash_attn_varlen_func, None, fa._pad_input, fa._unpad_input

    fa._lazy_imports = lazy_imports
    fa._loaded_implementation = None


def use_flash(model: torch.nn.Module) -> torch.nn.Module:
    """Switch a model built with another kernel to "flash_attention_2" (transformers refuses to build one
    without the flash-attn package, so the implementation is set after construction)."""
    model.config._attn_implementation = IMPLEMENTATION
    return model


# ---- flash-attn 2.8's private LSE functions, as real `torch.library.custom_op`s (what the ring calls) ----
# Same names, parameter order, types and return layout as `flash_attn.flash_attn_interface` (2.7+): dense
# [B, S, H, D] with LSE [B, H, S], varlen [T, H, D] with LSE [H, T], backward writing into dq/dk/dv. They
# compute in float64 on any device (the flash backward formula from the given out and LSE) and record
# each call's arguments in PRIVATE_CALLS. `install_private(monkeypatch)` puts them in `sys.modules`.

PRIVATE_CALLS: list[tuple[str, dict]] = []
Tensor = torch.Tensor


def _lse_block(q, k, v, scale, causal):
    """One segment in float64: q [sq, h, d], k/v [sk, hk, d] -> out [sq, h, dv], lse [h, sq], probs."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if causal:  # bottom-right aligned, as flash-attn >= 2.1
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(g, 1)), lse, p


def _grads_block(dout, q, k, v, out, lse, scale, causal):
    """The flash backward of one segment from the given (global) out and LSE."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -math.inf)
    p = torch.exp(s - lse.double()[..., None])
    do = dout.double()
    dp = torch.einsum("qhd,khd->hqk", do, v.double().repeat_interleave(g, 1))
    ds = p * (dp - (do * out.double()).sum(-1).transpose(0, 1)[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, k.double().repeat_interleave(g, 1)) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.double()) * scale
    dv = torch.einsum("hqk,qhd->khd", p, do)
    return dq, dk.unflatten(1, (k.shape[1], g)).sum(2), dv.unflatten(1, (k.shape[1], g)).sum(2)


def _last_dim_contiguous(*tensors: Tensor | None) -> None:
    """flash-attn's C++ API reads any batch / row / head stride but needs stride 1 along the head dim."""
    for t in tensors:
        assert t is None or t.stride(-1) == 1, f"last dimension not contiguous: stride {t.stride()}"


def _record(name: str, **kwargs) -> None:
    assert kwargs.pop("dropout_p") == 0.0 and kwargs.get("softcap", 0.0) == 0.0
    assert kwargs.get("window_size_left", -1) == -1 and kwargs.get("window_size_right", -1) == -1
    assert kwargs.get("alibi_slopes") is None
    PRIVATE_CALLS.append((name, kwargs))


@torch.library.custom_op("flash_standin::_flash_attn_forward", mutates_args=())
def _flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Tensor | None, return_softmax: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    _last_dim_contiguous(q, k, v)
    _record("forward", **{k_: v_ for k_, v_ in locals().items() if k_ not in ("q", "k", "v")}, k_ptr=k.data_ptr())
    res = [_lse_block(q[b], k[b], v[b], softmax_scale, causal) for b in range(q.shape[0])]
    out = torch.stack([o for o, _, _ in res]).to(q.dtype)
    return out, torch.stack([lse for _, lse, _ in res]).float(), q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("flash_standin::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor | None,
    dk: Tensor | None, dv: Tensor | None, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
    rng_state: Tensor | None = None,
) -> Tensor:  # fmt: skip
    _last_dim_contiguous(dout, q, k, v, out, dq, dk, dv)
    _record(
        "backward", causal=causal, softmax_scale=softmax_scale, deterministic=deterministic, dropout_p=dropout_p,
        k_ptr=k.data_ptr(),
    )  # fmt: skip
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == q.shape[:1] + (q.shape[2], q.shape[1])
    # flash-attn reads softmax_lse by data pointer as a contiguous [B, H, S] (flash_api.cpp checks nothing more).
    softmax_lse = raw_read(
        softmax_lse, tuple(softmax_lse.shape), tuple(softmax_lse.new_empty(softmax_lse.shape).stride())
    )
    for b in range(q.shape[0]):
        grads = _grads_block(dout[b], q[b], k[b], v[b], out[b], softmax_lse[b], softmax_scale, causal)
        for dst, src in zip((dq, dk, dv), grads, strict=True):
            dst[b].copy_(src)
    return softmax_lse.clone()


def _segments(cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, tq: int, tk: int):
    bq = _check_cu(cu_q, max_q, tq, cu_q)
    bk = _check_cu(cu_k, max_k, tk, cu_k)
    assert len(bq) == len(bk)
    return list(zip(bq[:-1], bq[1:], bk[:-1], bk[1:], strict=True))


@torch.library.custom_op("flash_standin::_flash_attn_varlen_forward", mutates_args=())
def _flash_attn_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Tensor | None = None,
    return_softmax: bool = False, block_table: Tensor | None = None, leftpad_k: Tensor | None = None,
    seqused_k: Tensor | None = None, zero_tensors: bool = False, num_splits: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    _record("varlen_forward", **{k_: v_ for k_, v_ in locals().items() if k_ not in ("q", "k", "v")})
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf)
    for a, b, c, d in _segments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0]):
        o, s, _ = _lse_block(q[a:b], k[c:d], v[c:d], softmax_scale, causal)
        out[a:b], lse[:, a:b] = o.to(q.dtype), s.float()
    return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("flash_standin::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _flash_attn_varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor | None,
    dk: Tensor | None, dv: Tensor | None, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: Tensor | None, deterministic: bool,
    rng_state: Tensor | None = None, zero_tensors: bool = False,
) -> Tensor:  # fmt: skip
    _record("varlen_backward", causal=causal, softmax_scale=softmax_scale, dropout_p=dropout_p)
    assert softmax_lse.dtype == torch.float32 and softmax_lse.shape == (q.shape[1], q.shape[0])
    softmax_lse = raw_read(softmax_lse, (q.shape[1], q.shape[0]), (q.shape[0], 1))  # by pointer, contiguous [H, T]
    dq.zero_(), dk.zero_(), dv.zero_()
    for a, b, c, d in _segments(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q.shape[0], k.shape[0]):
        grads = _grads_block(dout[a:b], q[a:b], k[c:d], v[c:d], out[a:b], softmax_lse[:, a:b], softmax_scale, causal)
        dq[a:b], dk[c:d], dv[c:d] = (g.to(q.dtype) for g in grads)
    return softmax_lse.clone()


def _fa3_dense_or_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    if cu_q is None:
        return _flash_attn_forward(q, k, v, 0.0, scale, causal, -1, -1, 0.0, None, False)[:2]
    return _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, scale, causal)[:2]


# FA3 (`hopper/flash_attn_interface.py`): one forward and one backward for dense and varlen, keyword
# defaults everywhere, `is_causal` in the backward (and its `sequed_*` spelling).
@torch.library.custom_op("flash_standin::fa3_forward", mutates_args=())
def _fa3_forward(
    q: Tensor, k: Tensor, v: Tensor, k_new: Tensor | None = None, v_new: Tensor | None = None,
    qv: Tensor | None = None, out_: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None, cu_seqlens_k_new: Tensor | None = None, seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    page_table: Tensor | None = None, kv_batch_idx: Tensor | None = None, leftpad_k: Tensor | None = None,
    rotary_cos: Tensor | None = None, rotary_sin: Tensor | None = None, seqlens_rotary: Tensor | None = None,
    q_descale: Tensor | None = None, k_descale: Tensor | None = None, v_descale: Tensor | None = None,
    softmax_scale: float | None = None, causal: bool = False, window_size_left: int = -1,
    window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0, rotary_interleaved: bool = True,
    scheduler_metadata: Tensor | None = None, num_splits: int = 1, pack_gqa: bool | None = None, sm_margin: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    assert softmax_scale is not None and attention_chunk == 0 and k_new is None and out_ is None
    out, lse = _fa3_dense_or_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal
    )
    PRIVATE_CALLS.append(("fa3_forward", {"causal": causal, "varlen": cu_seqlens_q is not None}))
    return out.clone(), lse.clone(), q.new_empty(0), q.new_empty(0)


@torch.library.custom_op("flash_standin::fa3_backward", mutates_args=("dq", "dk", "dv"))
def _fa3_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
    cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None, sequed_q: Tensor | None = None,
    sequed_k: Tensor | None = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
    dq: Tensor | None = None, dk: Tensor | None = None, dv: Tensor | None = None, softmax_scale: float | None = None,
    is_causal: bool = False, window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    deterministic: bool = False, sm_margin: int = 0,
) -> Tensor:  # fmt: skip
    assert dq is not None and dk is not None and dv is not None and softmax_scale is not None
    PRIVATE_CALLS.append(("fa3_backward", {"is_causal": is_causal, "varlen": cu_seqlens_q is not None}))
    if cu_seqlens_q is None:
        _flash_attn_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, 0.0, softmax_scale, is_causal, -1, -1, 0.0, None, deterministic
        )
    else:
        _flash_attn_varlen_backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            0.0, softmax_scale, is_causal, -1, -1, 0.0, None, deterministic,
        )  # fmt: skip
    return softmax_lse.clone()


def install_fa3(monkeypatch) -> None:
    """Make `flash_attn_interface` (FA3) these custom ops for one test (flash-attn 2 absent)."""
    import sys
    import types

    interface = types.ModuleType("flash_attn_interface")
    interface._flash_attn_forward, interface._flash_attn_backward = _fa3_forward, _fa3_backward
    monkeypatch.setitem(sys.modules, "flash_attn_interface", interface)
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    PRIVATE_CALLS.clear()


def install_private(monkeypatch, version: str = "2.8.3") -> None:
    """Make `flash_attn` (and `flash_attn.flash_attn_interface`) these custom ops for one test."""
    import sys
    import types

    package, interface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    package.__version__, package.__path__, package.flash_attn_interface = version, [], interface
    interface._flash_attn_forward, interface._flash_attn_backward = _flash_attn_forward, _flash_attn_backward
    interface._flash_attn_varlen_forward = _flash_attn_varlen_forward
    interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # no FA3: its import raises ImportError
    PRIVATE_CALLS.clear()

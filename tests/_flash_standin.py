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

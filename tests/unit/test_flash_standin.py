"""The CPU flash-attn stand-in refuses what the real kernel refuses and computes plain attention."""

from __future__ import annotations

import math

import pytest
import torch

from tests import _flash_standin as fs


def _qkv(total: int = 10, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(total, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))


def _explicit(q, k, v, window: int | None = None, softcap: float = 0.0, sinks=None):
    """One segment with an explicit additive mask, written independently of the stand-in."""
    s, h, d = q.shape
    k, v = k.repeat_interleave(h // k.shape[1], 1), v.repeat_interleave(h // v.shape[1], 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    ok = (j <= i) & ((i - j < window) if window else True)
    scores = scores.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(h, 1, 1).expand(h, s, 1)], -1)
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_varlen_matches_explicit_attention_per_segment_with_window_softcap_and_sinks():
    q, k, v = _qkv()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(1))
    out = fs.flash_attn_varlen_func(q, k, v, cu, cu, 6, 6, causal=True, window_size=(2, 2), softcap=5.0, s_aux=sinks)
    for a, b in ((0, 4), (4, 10)):
        want = _explicit(q[a:b], k[a:b], v[a:b], window=3, softcap=5.0, sinks=sinks)
        torch.testing.assert_close(out[a:b], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cu_seqlens_q": torch.tensor([0, 4, 10])}, "int32"),
        ({"max_seqlen_q": torch.tensor(6)}, "int"),
        ({"max_seqlen_q": 5}, ""),
        ({"causal": torch.tensor(True)}, ""),
        ({"window_size": [2, 2]}, ""),
        ({"softcap": 1}, ""),
    ],
)
def test_varlen_refuses_what_flash_attn_refuses(change, message):
    q, k, v = _qkv()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    kwargs = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 6, "max_seqlen_k": 6, "causal": True}
    with pytest.raises(AssertionError, match=message or None):
        fs.flash_attn_varlen_func(q, k, v, **{**kwargs, **change})

"""How windowed and chunked attention is cut into kernel calls (issue 38): small, exact, and only where pairs are
visible. The ring's window tiles and chunk segments (`ring/band.py`, `ring/plan.py`), packed blocks segment by
segment (`lse/loop.py`), and Ulysses' sdpa / eager band (`attention/local.py`) against dense references."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_longctx.attention.blocks import band_rows, plan_segment
from hf_longctx.attention.local import attend_blocks
from hf_longctx.attention.lse.cpu import CpuFlashKernel, MathKernel
from hf_longctx.attention.lse.loop import segment_loop
from hf_longctx.attention.ring.plan import VisibilityRule, plan_ring
from hf_longctx.data.layout import layout_indices


def _doc_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)


def _no_dense(monkeypatch) -> None:
    def refuse(*args):
        raise AssertionError("the planner built a dense [queries, keys] mask")

    monkeypatch.setattr(VisibilityRule, "allowed", refuse)


@pytest.mark.parametrize(("layout", "world"), [("zigzag", 2), ("contiguous", 4), ("zigzag", 4)])
@pytest.mark.parametrize("packed", [False, True])
def test_window_tiles_are_small_and_cover_only_visible_pairs(monkeypatch, layout, world, packed):
    """8,192 tokens, window 100: no mask beyond rows x (rows + W - 1), at most twice the visible pairs computed,
    block pairs out of the window skipped, and no dense mask while planning."""
    seq, window = 8192, 100
    doc = _doc_ids([3000, 17, 5175]) if packed else None
    indices = [layout_indices(layout, r, world, seq) for r in range(world)]
    rule = VisibilityRule(doc, window=window)
    visible = sum(min(i + 1, window) for i in range(seq)) if not packed else None
    _no_dense(monkeypatch)
    rows = band_rows(window)
    computed, calls = 0, 0
    for rank in range(world):
        for src, plans in enumerate(plan_ring(indices, rank, rule)):
            gap = (indices[rank][:, None] - indices[src][None, :]).clamp(min=0)
            if not bool(((gap < window) & (indices[src][None, :] <= indices[rank][:, None])).any()):
                assert plans == (), (rank, src)  # nothing visible: skipped
            for plan in plans:
                n, m = plan.rows.stop - plan.rows.start, plan.cols.stop - plan.cols.start
                assert n <= rows and m <= rows + window - 1, (rank, src, n, m)
                if plan.allowed is not None:
                    assert plan.allowed.numel() <= rows * (rows + window - 1)
                computed += plan.pairs
                calls += 1
    if visible is not None:
        assert visible <= computed <= 2 * visible, (computed, visible)
    assert calls <= world * 2 * (seq // world // rows + 2)  # O(S / W) calls, not O(S^2)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_chunked_blocks_are_planned_as_segments_without_a_dense_mask(monkeypatch, layout):
    seq = 4096
    pos = torch.cat([torch.arange(1000), torch.arange(3096)]).unsqueeze(0)
    rule = VisibilityRule(_doc_ids([1000, 3096]), chunk=256, position_ids=pos)
    indices = [layout_indices(layout, r, 2, seq) for r in range(2)]
    _no_dense(monkeypatch)
    plans = [p for r in range(2) for parts in plan_ring(indices, r, rule) for p in parts]
    assert plans and all(p.allowed is None for p in plans)
    assert any(p.segments is not None for p in plans)


def test_packed_blocks_run_segment_by_segment_on_the_cpu_kernel():
    """A long document over both zigzag chunks of a rank (its keys listed in two segments), a 1-token document:
    the per-segment CPU kernel equals the float64 math kernel on the dense mask the segments stand for."""
    seq, world = 64, 4
    doc = _doc_ids([6, 1, 49, 8])
    indices = [layout_indices("zigzag", r, world, seq) for r in range(world)]
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, h, 16, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    loop, math_kernel, seen = segment_loop(CpuFlashKernel()), MathKernel(), 0
    for rank in range(world):
        for parts in plan_ring(indices, rank, VisibilityRule(doc)):
            for plan in (p for p in parts if p.segments is not None):
                args = (q[:, :, plan.rows], k[:, :, plan.cols], v[:, :, plan.cols])
                mask = plan.mask(1)
                out, lse = loop.forward(*args, causal=False, allowed=None, scale=0.3, segments=plan.segments)
                ref_out, ref_lse = math_kernel.forward(*args, causal=False, allowed=mask, scale=0.3)
                torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
                torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
                d = dout[:, :, plan.rows]
                grads = loop.backward(d, *args, out, lse, causal=False, allowed=None, scale=0.3, segments=plan.segments)
                want = math_kernel.backward(d, *args, ref_out, ref_lse, causal=False, allowed=mask, scale=0.3)
                for got, ref in zip(grads, want, strict=True):
                    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
                seen += 1
    assert seen >= 4


class _Module(torch.nn.Module):
    """What transformers' sdpa / eager kernels read of an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


@pytest.mark.parametrize("family", ["sdpa", "eager"])
@pytest.mark.parametrize("window", [20, 64, 100])
def test_ulysses_band_equals_dense_window_attention(family, window):
    """A packed batch of two rows (documents of 300, 7 and 163; one of 470): the band's first block, batched inner
    blocks and rest give the dense window attention's output and gradients, in float64."""
    kernel = sdpa_attention_forward if family == "sdpa" else eager_attention_forward
    segments = [[(0, 300), (300, 307), (307, 470)], [(0, 470)]]
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, h, 470, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    calls = []

    def counted(module, q_, k_, v_, mask, **kwargs):
        calls.append(q_.shape[0])
        return kernel(module, q_, k_, v_, mask, **kwargs)

    out = attend_blocks(counted, _Module(2), family, segments, q, k, v, {"scaling": 0.3, "dropout": 0.0}, window)
    doc = torch.stack([_doc_ids([300, 7, 163])[0], torch.zeros(470, dtype=torch.long)])
    i = torch.arange(470)
    allowed = (doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    ref = (torch.softmax(s.masked_fill(~allowed[:, None], -math.inf), -1) @ v.repeat_interleave(2, 1)).transpose(1, 2)
    tol = 1e-12 if family == "sdpa" else 1e-6  # transformers' eager softmax runs in float32
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout),
                         strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=tol * 10)
    assert max(calls) > 1  # inner blocks ran batched
    inner = [b for b in plan_segment(470, window, family == "eager") if b.repeat > 1]
    assert inner and inner[0].keys == band_rows(window) + window - 1


def test_ulysses_band_keeps_gpt_oss_sinks_in_every_batched_block():
    """GPT-OSS's eager kernel (a learned sink logit per head in every softmax) on the band's batched inner blocks:
    the same as dense window attention with the sink column."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as sink_kernel

    window, seq = 20, 300
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, seq, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    module = _Module(2)
    module.sinks = torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))
    out = attend_blocks(sink_kernel, module, "eager", [[(0, seq)]], q, k, v, {"scaling": 0.3, "dropout": 0.0}, window)
    i = torch.arange(seq)
    allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    s = ((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3).masked_fill(~allowed, -math.inf)
    sink = module.sinks.view(1, 4, 1, 1).expand(1, 4, seq, 1)
    probs = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    ref = (probs @ v.repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)  # the kernel's softmax runs in float32
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    leaves = (q, k, v, module.sinks)
    for got, want in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, leaves, dout), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

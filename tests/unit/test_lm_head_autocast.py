"""The tiled LM head under autocast (CPU bfloat16 here, CUDA in tests/gpu): every gradient has the dtype
the untiled path gives and its value within bfloat16 tolerance; the backward of TRL's fields recomputes
the logits under the forward's autocast; the weight-gradient matmul runs on autocast-dtype operands."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hf_longctx.memory.lm_head import linear_cross_entropy_sum, linear_token_stats

N, H, V, TILE = 29, 32, 96, 8
BF16 = torch.bfloat16


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.8).to(dtype).requires_grad_()  # logits of size ~5
    bias = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    labels[3] = -100
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, bias, labels, g_lp, g_ent


def _grads(loss, *params):
    loss.backward()
    return [p.grad for p in params]


def _close(ours: torch.Tensor, ref: torch.Tensor, rtol: float) -> float:
    err = float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())
    assert ours.dtype == ref.dtype
    assert err <= rtol, err
    return err


def _reference_stats(hidden, weight, bias, labels, g_lp, g_ent):
    logits = F.linear(hidden, weight, bias).float()
    logp = logits.log_softmax(-1)
    valid = labels != -100
    lp = torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    return (g_lp * lp).sum() + (g_ent * ent).sum()


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32_params", "bf16_params"])
def test_token_stats_backward_under_autocast_matches_untiled(dtype):
    """The backward recomputes the logits under forward's autocast (it recomputed them in float32 before:
    a gradient off by the bfloat16 rounding of the logits, ~1e-2 of its size)."""
    ref_in, our_in = _inputs(dtype), _inputs(dtype)
    with torch.autocast("cpu", dtype=BF16):
        ref = _grads(_reference_stats(*ref_in), *ref_in[:3])
        h, w, b, labels, g_lp, g_ent = our_in
        stats = linear_token_stats(h, w, b, labels, wanted=("log_probs", "entropy"), tile=TILE)
        ours = _grads((g_lp * stats["log_probs"]).sum() + (g_ent * stats["entropy"]).sum(), h, w, b)
    for o, r in zip(ours, ref, strict=True):
        _close(o, r, 8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32_params", "bf16_params"])
def test_cross_entropy_sum_under_autocast_matches_untiled(dtype):
    ref_in, our_in = _inputs(dtype), _inputs(dtype)
    with torch.autocast("cpu", dtype=BF16):
        h, w, b, labels = ref_in[:4]
        ref_loss = F.cross_entropy(F.linear(h, w, b).float(), labels, reduction="sum")
        ref = _grads(ref_loss, h, w, b)
        h, w, b, labels = our_in[:4]
        loss = linear_cross_entropy_sum(h, w, b, labels, tile=TILE)
        ours = _grads(loss, h, w, b)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    for o, r in zip(ours, ref, strict=True):
        _close(o, r, 8e-3)


class _Matmuls(TorchDispatchMode):
    """Operands of every matmul whose result has the vocabulary x hidden shape of the weight gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.operands: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_) and out.shape == (V, H):
            mats = args[:2] if packet is torch.ops.aten.mm else args[1:3]
            self.operands += [m.detach().clone() for m in mats]
        return out


@pytest.mark.parametrize("which", ["cross_entropy", "token_stats"])
def test_weight_gradient_matmul_runs_in_the_autocast_dtype(which):
    """Its operands are bfloat16 values (float32 sums), as in the untiled path; before, a float32 matmul of
    float32 operands ran outside autocast."""
    h, w, b, labels, g_lp, _ = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=BF16), _Matmuls() as seen:
        if which == "cross_entropy":
            linear_cross_entropy_sum(h, w, b, labels, tile=TILE).backward()
        else:
            (g_lp * linear_token_stats(h, w, b, labels, tile=TILE)["log_probs"]).sum().backward()
    assert seen.operands
    for t in seen.operands:
        assert torch.equal(t.float(), t.to(BF16).float()), "a weight-gradient operand is not a bfloat16 value"

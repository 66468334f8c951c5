"""GPU-only paths of the memory flags (skipped without CUDA; run through the device tool).

On CUDA `offload_activations` copies layer inputs to pinned host memory on a side stream and prefetches
them back; `tiled_loss` uses Liger's fused linear cross-entropy only when `tiled_loss="liger"` asks for it
and leaves TRL's fused head to its Triton kernel; under bfloat16 autocast its gradients match the untiled
path's in dtype and value. Each flag on vs off must still give the same loss and gradients (float32 here).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu


def _model():
    from tests._models import tiny_model

    return tiny_model("llama", num_heads=4, num_kv_heads=2, hidden=128, layers=3).cuda()


def _step(model, flags: dict) -> tuple[float, dict[str, torch.Tensor], dict]:
    from hf_longctx.memory import apply_memory_flags

    g = torch.Generator("cuda").manual_seed(0)
    ids = torch.randint(0, 128, (2, 301), device="cuda", generator=g)
    with apply_memory_flags(model, SimpleNamespace(**flags)) as handle:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        parts = dict(handle.parts)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.loss.item(), grads, parts


@pytest.mark.parametrize(
    "flags", [{"offload_activations": True}, {"tiled_loss": True}, {"tiled_mlp": 4}], ids=lambda f: next(iter(f))
)
def test_flag_on_cuda_matches_off(flags):
    model = _model()
    ref_loss, ref_grads, _ = _step(model, {})
    loss, grads, parts = _step(model, flags)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for name, ref in ref_grads.items():
        assert (grads[name] - ref).abs().max() <= 1e-4 * ref.abs().max(), name
    if "offload_activations" in flags:
        offload = parts["offload_activations"].offload
        assert offload._stream is not None  # the copies ran on the side stream


def test_offloaded_inputs_leave_the_gpu():
    """With offload the device memory held between forward and backward drops by about L x [n, h]."""
    from hf_longctx.memory import apply_memory_flags

    model = _model()
    ids = torch.randint(0, 128, (1, 8192), device="cuda")
    held = {}
    for name, flags in (("checkpointing", None), ("offload", {"offload_activations": True})):
        if flags is None:
            model.activation_checkpointing_enable({"use_reentrant": False})
            handle = None
        else:
            model.gradient_checkpointing_disable()
            handle = apply_memory_flags(model, SimpleNamespace(**flags))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        if handle is not None:
            handle.remove()
    layer_input = 8192 * 128 * 4
    assert held["checkpointing"] - held["offload"] >= 2 * layer_input  # 3 layers' inputs, minus slack


def test_installed_liger_is_used_only_when_asked_for(monkeypatch):
    import sys
    import types

    calls = []

    def liger_fused_linear_cross_entropy(states, weight, targets, bias, **kwargs):
        calls.append(kwargs)
        logits = torch.nn.functional.linear(states, weight, bias).float()
        return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")

    module = types.ModuleType("liger_kernel.transformers.functional")
    module.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers", module.__name__):
        monkeypatch.setitem(sys.modules, name, module)
    model = _model()
    ref_loss, _, _ = _step(model, {})
    loss, _, _ = _step(model, {"tiled_loss": True})
    assert not calls  # was swapped in silently on CUDA
    liger_loss, _, _ = _step(model, {"tiled_loss": "liger"})
    assert len(calls) == 1 and calls[0]["reduction"] == "sum"
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and abs(liger_loss - ref_loss) <= 1e-5 * abs(ref_loss)


def test_tiled_loss_under_bf16_autocast_matches_untiled():
    """The weight gradient's matmul runs in bfloat16 with float32 accumulation (addmm out_dtype)."""
    from hf_longctx.memory import apply_memory_flags

    model = _model().to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 301), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    grads = []
    for flags in ({}, {"tiled_loss": True}):
        with apply_memory_flags(model, SimpleNamespace(**flags)), torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    for name, ref in grads[0].items():
        assert grads[1][name].dtype == ref.dtype == torch.bfloat16, name
        assert (grads[1][name].float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max(), name

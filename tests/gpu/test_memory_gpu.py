"""GPU-only paths of the memory flags, in bf16 at a size where dtype and streams matter (skipped without CUDA).

The model is the `Trainer(bf16=True)` case: float32 weights under bfloat16 autocast, 4 layers of hidden 1024,
vocabulary 32,000, 16,384 tokens, so the logits (1 GiB in bf16, 2 GiB upcast) and the layer inputs (32 MiB each)
dominate device memory. On CUDA `offload_activations` copies each layer input to pinned host memory on a side
stream and prefetches it back; `tiled_loss` never materialises the logits; `tiled_mlp` runs the MLP per tile.
Each flag must (a) train like the run without it: its error against a float32 reference no larger than the
unflagged bf16 run's own error (x2, the way bf16 kernels are judged), and (b) lower the device memory it is for.
`tiled_loss` picks Liger only when `tiled_loss="liger"` asks for it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

SEQ, VOCAB, HIDDEN, LAYERS = 16384, 32000, 1024, 4


def _model():
    from tests._models import tiny_model

    return tiny_model("llama", num_heads=16, num_kv_heads=4, hidden=HIDDEN, layers=LAYERS, vocab=VOCAB).cuda()


def _ids(seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))


def _step(model, flags: dict, autocast: bool = True, checkpointing: bool = False) -> dict:
    """One forward + backward; loss, float32 gradients, the device peak above the start and the flag parts."""
    from hf_longctx.memory import apply_memory_flags

    ids = _ids()
    if checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    with apply_memory_flags(model, SimpleNamespace(**flags)) as handle:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        parts = dict(handle.parts)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_disable()
    return {"loss": loss.item(), "grads": grads, "peak": peak, "parts": parts}


def _errors(run: dict, ref: dict) -> tuple[float, float]:
    loss = abs(run["loss"] - ref["loss"]) / abs(ref["loss"])
    grad = max(float((run["grads"][n] - g).abs().max() / g.abs().max()) for n, g in ref["grads"].items())
    return loss, grad


@pytest.fixture(scope="module")
def runs():
    """The float32 reference and the unflagged bf16 run, shared by every flag."""
    model = _model()
    return model, _step(model, {}, autocast=False), _step(model, {})


@pytest.mark.parametrize(
    "flags", [{"offload_activations": True}, {"tiled_loss": True}, {"tiled_mlp": 4}], ids=lambda f: next(iter(f))
)
def test_flag_in_bf16_trains_like_the_unflagged_run(runs, flags):
    model, ref, plain = runs
    flagged = _step(model, flags)
    plain_loss, plain_grad = _errors(plain, ref)
    loss, grad = _errors(flagged, ref)
    assert loss <= 2 * plain_loss + 1e-4 and grad <= 2 * plain_grad + 1e-3, (loss, grad, plain_loss, plain_grad)
    if "offload_activations" in flags:
        assert flagged["parts"]["offload_activations"].offload._stream is not None  # copies ran on the side stream


def test_tiled_loss_drops_the_logits(runs):
    model, _, plain = runs
    tiled = _step(model, {"tiled_loss": True})
    logits_bf16 = SEQ * VOCAB * 2
    assert plain["peak"] - tiled["peak"] >= logits_bf16, (plain["peak"], tiled["peak"])


def test_offload_frees_the_checkpointed_layer_inputs(runs):
    """Between forward and backward, offload keeps about L x [S, h] fewer bytes on the device than checkpointing."""
    from hf_longctx.memory import apply_memory_flags

    model = runs[0]
    held = {}
    for name in ("checkpointing", "offload"):
        if name == "checkpointing":
            model.gradient_checkpointing_enable({"use_reentrant": False})
        handle = apply_memory_flags(model, SimpleNamespace(offload_activations=name == "offload"))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=_ids(), labels=_ids()).loss
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        handle.remove()
        model.gradient_checkpointing_disable()
    layer_input = SEQ * HIDDEN * 4  # the residual stream stays float32 under autocast
    assert held["checkpointing"] - held["offload"] >= (LAYERS - 1) * layer_input, held


def test_tiled_mlp_lowers_the_peak_under_checkpointing(runs):
    """With the logits gone (tiled_loss) the peak is a recomputed layer's backward, where the MLP's
    [S, intermediate] tensors dominate; 8 tiles keep an eighth of them alive."""
    model = runs[0]
    whole = _step(model, {"tiled_loss": True}, checkpointing=True)
    tiled = _step(model, {"tiled_loss": True, "tiled_mlp": 8}, checkpointing=True)
    mlp_transient = SEQ * 2 * HIDDEN * 2  # one [S, intermediate] bf16 activation
    assert whole["peak"] - tiled["peak"] >= mlp_transient // 2, (whole["peak"], tiled["peak"])


def test_installed_liger_is_used_only_when_asked_for(monkeypatch, runs):
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
    model, _, plain = runs
    tiled = _step(model, {"tiled_loss": True})
    assert not calls  # never swapped in silently
    liger = _step(model, {"tiled_loss": "liger"})
    assert len(calls) == 1 and calls[0]["reduction"] == "sum"
    for run in (tiled, liger):
        assert abs(run["loss"] - plain["loss"]) <= 1e-2 * abs(plain["loss"])


def test_tiled_loss_in_pure_bf16_keeps_the_gradient_dtype():
    """Weights in bfloat16 (no master copy): the weight gradient's matmul runs in bf16 with fp32 accumulation."""
    from hf_longctx.memory import apply_memory_flags

    model = _model().to(torch.bfloat16)
    ids = _ids(4096)
    grads = []
    for flags in ({}, {"tiled_loss": True}):
        with apply_memory_flags(model, SimpleNamespace(**flags)), torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    for name, ref in grads[0].items():
        assert grads[1][name].dtype == ref.dtype == torch.bfloat16, name
        assert (grads[1][name].float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max(), name

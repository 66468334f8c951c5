"""`tiled_layer` in one process (SP=1): on vs off gives the same loss and every parameter's gradient for
several tile counts (some not dividing the length), packed rows, gradient checkpointing, offload, the
tile attention equals dense attention, unsupported layers stay untiled, and the handle restores the model."""

from __future__ import annotations

import logging
import weakref
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hf_longctx import ParallelismConfig
from hf_longctx.memory import apply_memory_flags
from hf_longctx.memory.tile_attention import KVGradients, plan_pieces, release_kv, tile_attention
from hf_longctx.memory.tiled_layer import enable_tiled_layer
from tests._models import tiny_model

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5


def _batch(packed: bool, bs: int = 2, sl: int = 37):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (bs, sl), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packed:  # documents of 11, 9 and 17 tokens in row 0, 20 and 17 in row 1
        pos = [torch.cat([torch.arange(n) for n in lengths]) for lengths in ((11, 9, 17), (20, 17))[:bs]]
        batch["position_ids"] = torch.stack(pos)
    return batch


def _loss_and_grads(model, batch):
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _max_errors(loss, grads, ref, ref_grads) -> tuple[float, float]:
    assert grads.keys() == ref_grads.keys()
    loss_err = (abs(loss - ref) / abs(ref)).item()
    grad_err = max(((grads[n] - r).abs().max() / r.abs().max().clamp(min=1e-30)).item() for n, r in ref_grads.items())
    return loss_err, grad_err


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_tiled_layer_matches_loss_and_every_gradient(arch, packed):
    model = tiny_model(arch)
    batch = _batch(packed)
    ref, ref_grads = _loss_and_grads(model, batch)
    # 3 and 5 do not divide 37; 40 is capped at one token per tile (slow: llama only)
    for tiles in (2, 3, 5, 40) if arch == "llama" else (3,):
        with apply_memory_flags(model, SimpleNamespace(tiled_layer=tiles)) as handle:
            assert len(handle.parts["tiled_layer"].layers) == 2
            assert handle.parts["tiled_layer"].norms == ["model.norm"]  # the final norm runs over the tiles too
            loss, grads = _loss_and_grads(model, batch)
        loss_err, grad_err = _max_errors(loss, grads, ref, ref_grads)
        assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, (tiles, loss_err, grad_err)


def test_tiled_layer_with_checkpointing_and_the_other_flags():
    model = tiny_model("llama")
    batch = _batch(packed=True)
    ref, ref_grads = _loss_and_grads(model, batch)
    model.activation_checkpointing_enable({"use_reentrant": False})
    flags = SimpleNamespace(tiled_layer=3, tiled_mlp=2, tiled_loss=True)
    with apply_memory_flags(model, flags) as handle:
        assert handle.parts["tiled_mlp"].modules == []  # the tiled layers tile their own MLPs
        loss, grads = _loss_and_grads(model, batch)
    loss_err, grad_err = _max_errors(loss, grads, ref, ref_grads)
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL
    assert "forward" not in model.model.layers[0].__dict__  # nothing stays applied


def test_tiled_layer_with_offload_keeps_each_layer_input_on_the_host(monkeypatch):
    """With offload_activations what the tiles save of a layer's input (its tile views) shares one host copy per
    layer (always_copy: the accelerator's path on CPU), fetched back for the layer's backward and freed after it;
    no extra forward runs (each tile twice: forward and its recompute), and it stays exact."""
    from hf_longctx.memory import offload, tiled_layer

    model = tiny_model("llama").train()
    batch = _batch(packed=True)
    ref, ref_grads = _loss_and_grads(model, batch)
    copies, views, tiles = set(), [], []
    pack = offload.HostOffload._pack

    def recording(self, group, inputs, t):
        out = pack(self, group, inputs, t)
        if isinstance(out, offload._View | offload._Saved):
            saved = out.saved if isinstance(out, offload._View) else out
            copies.add(saved)
            views.append(out)
        return out

    monkeypatch.setattr(offload.HostOffload, "_pack", recording)
    tile = tiled_layer._TiledLayer.tile
    monkeypatch.setattr(tiled_layer._TiledLayer, "tile", lambda self, *a: tiles.append(1) or tile(self, *a))
    ParallelismConfig(tiled_layer=True, offload_activations=True)  # the pair is accepted
    offloaded = offload.enable_offload_activations(model, always_copy=True)
    with enable_tiled_layer(model, 3) as handle:
        assert len(handle.layers) == 2
        loss, grads = _loss_and_grads(model, batch)
    offloaded.remove()
    assert len(copies) == 2 and all(s.host.shape == (2, 37, model.config.hidden_size) for s in copies)
    assert all(s.pending == 0 and s.fetched is None for s in copies)  # every saved tile unpacked, device copy gone
    assert len(views) == 2 * (3 + 3 + 1)  # per layer: the K/V tiles, the query tiles, the input for K/V's recompute
    assert len(tiles) == 2 * 3 * 2
    loss_err, grad_err = _max_errors(loss, grads, ref, ref_grads)
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, (loss_err, grad_err)


def test_a_tiled_layer_keeps_only_its_input_until_backward(monkeypatch):
    # The forward's K/V (and every tile's activations) are freed when the forward returns; backward
    # recomputes them. A weak reference to each K the tiles attend to must be dead before backward.
    from hf_longctx.memory import tiled_layer

    model = tiny_model("llama")
    batch = _batch(packed=True)
    ref, ref_grads = _loss_and_grads(model, batch)
    keys: list[weakref.ref] = []
    attend = tiled_layer.tile_attention

    def recording(q, k, v, pieces, scale, grads):
        keys.append(weakref.ref(k))
        return attend(q, k, v, pieces, scale, grads)

    monkeypatch.setattr(tiled_layer, "tile_attention", recording)
    with enable_tiled_layer(model, 4):
        out = model(**batch)
        assert len(keys) == 8 and all(ref() is None for ref in keys)  # 4 tiles x 2 layers, all freed
        out.loss.backward()
    assert len(keys) == 16  # backward: every tile recomputed once
    grads = {n: p.grad for n, p in model.named_parameters()}
    _, grad_err = _max_errors(ref, grads, ref, ref_grads)
    assert grad_err <= GRAD_RTOL


def test_tile_attention_equals_dense_attention_per_document():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 23, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    segments = [[(0, 7), (7, 16), (16, 23)]]
    doc = torch.tensor([0] * 7 + [1] * 9 + [2] * 7)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(23, 23, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed)
    grads = KVGradients()
    kt, vt = release_kv(k, v, grads)
    outs = []
    for a, b in ((0, 5), (5, 12), (12, 23)):
        outs.append(tile_attention(q[:, :, a:b], kt, vt, plan_pieces(segments, [(0, a, b - a)]), 8**-0.5, grads))
    out = torch.cat(outs, dim=2)
    torch.testing.assert_close(out, ref)
    got = torch.autograd.grad((out * out).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref).sum(), (q, k, v))
    for a, b in zip(got, ref_grads, strict=True):
        torch.testing.assert_close(a, b)
    assert len(grads.sums) == 2 and all(s.buffer is None for s in grads.sums)  # handed to K/V once, then forgotten


def test_unsupported_layers_stay_untiled_and_are_logged(caplog):
    for arch, why in (("gemma2", "children"), ("gpt_oss", "forward"), ("llama4", "")):
        model = tiny_model(arch, attn="eager")
        with caplog.at_level(logging.INFO, logger="hf_longctx.memory.tiled_layer"):
            handle = enable_tiled_layer(model, 2)
        assert handle.layers == [] and len(handle.untiled) == 2 and all(why in r for r in handle.untiled.values())
        assert "untiled" in caplog.text
        handle.remove()
    model = tiny_model("qwen3")
    model.config.layer_types[1] = "sliding_attention"
    model.model.layers[1].self_attn.sliding_window = 8
    with enable_tiled_layer(model, 2) as handle:
        assert handle.layers == ["model.layers.0"] and "sliding window" in handle.untiled["model.layers.1"]


def test_right_padding_is_exact_and_left_padding_or_a_cross_document_mask_refused():
    model = tiny_model("llama")
    batch = _batch(packed=False)
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    batch["attention_mask"][1, 30:] = 0
    batch["labels"][1, 30:] = -100
    ref, ref_grads = _loss_and_grads(model, batch)
    with enable_tiled_layer(model, 3):
        loss, grads = _loss_and_grads(model, batch)
        loss_err, grad_err = _max_errors(loss, grads, ref, ref_grads)
        assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL
        with pytest.raises(ValueError, match="tiled_layer=False"):
            model(**{**batch, "attention_mask": batch["attention_mask"].flip(-1)})  # left padding
        # transformers builds no per-document mask when position_ids come with an attention_mask: the model
        # itself attends across the packed documents, which the tiles would not reproduce
        with pytest.raises(ValueError, match="tiled_layer=False"):
            model(**{**batch, "position_ids": _batch(packed=True)["position_ids"]})


def test_eval_forward_and_remove_restore_the_model():
    model = tiny_model("llama")
    batch = _batch(packed=True)
    with torch.no_grad():
        ref = model(**batch).logits
        handle = apply_memory_flags(model, SimpleNamespace(tiled_layer=4))
        assert "forward" in model.model.layers[0].__dict__
        out = model(**batch).logits
    handle.remove()
    handle.remove()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert "forward" not in model.model.layers[0].__dict__ and "forward" not in model.model.norm.__dict__


def test_config_validates_tiled_layer():
    assert ParallelismConfig(tiled_layer=3).memory_enabled
    for bad in (0, -1, 2.5, "yes"):
        with pytest.raises(ValueError, match="tiled_layer must be"):
            ParallelismConfig(tiled_layer=bad)
    with pytest.raises(ValueError, match="tiled_layer"):
        ParallelismConfig(sp_size=2, sp_backend="deepspeed", tiled_layer=True)


@pytest.mark.parametrize("tiled", [False, True], ids=["checkpointed", "tiled"])
def test_offloaded_layer_inputs_leave_the_device_until_backward(tiled):
    """With offload_activations (always_copy: the accelerator's path on CPU) no layer input outlives the forward
    in its own memory: only its host copy waits for backward. A second backward over the retained graph fetches
    the inputs again (gradients double)."""
    from hf_longctx.memory import offload

    model = tiny_model("llama").train()
    batch = _batch(packed=True)
    _, ref_grads = _loss_and_grads(model, batch)
    inputs: list[weakref.ref] = []
    hooks = [
        layer.register_forward_pre_hook(lambda m, a: inputs.append(weakref.ref(a[0]))) for layer in model.model.layers
    ]
    handle = offload.enable_offload_activations(model, always_copy=True)
    with enable_tiled_layer(model, 3) if tiled else nullcontext():
        out = model(**batch)
        assert len(inputs) == 2 and all(ref() is None for ref in inputs)  # freed: the host copies hold them
        out.loss.backward(retain_graph=True)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out.loss.backward()
        twice = {n: p.grad for n, p in model.named_parameters()}
    handle.remove()
    for h in hooks:
        h.remove()
    _, grad_err = _max_errors(out.loss.detach(), grads, out.loss.detach(), ref_grads)
    assert grad_err <= GRAD_RTOL
    assert all(torch.allclose(twice[n], 2 * g, rtol=1e-5, atol=1e-7) for n, g in grads.items())


def test_tiled_layer_under_autocast_matches_the_untiled_layer():
    """fp32 weights under bf16 autocast (Trainer's bf16=True on an fp32 model): the tiles' q, k, v go to bf16 as
    autocast sends sdpa's, and backward recomputes K/V under the forward's autocast, so the tiled step stays
    within bf16 round-off of the untiled one (both measured against fp32)."""
    model = tiny_model("llama")
    batch = _batch(packed=True)
    ref, ref_grads = _loss_and_grads(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, plain_grads = _loss_and_grads(model, batch)
        with enable_tiled_layer(model, 3):
            tiled, tiled_grads = _loss_and_grads(model, batch)
    plain_err = _max_errors(plain, plain_grads, ref, ref_grads)
    tiled_err = _max_errors(tiled, tiled_grads, ref, ref_grads)
    assert 0 < plain_err[1] < 0.1  # bf16 round-off, measurable
    assert tiled_err[0] <= 2 * plain_err[0] + 1e-3 and tiled_err[1] <= 2 * plain_err[1], (tiled_err, plain_err)

"""The three memory flags in one process (SP=1): each flag on vs off gives the same loss and every
parameter's gradient, the TRL fused-head outputs equal TRL's own kernel field by field, and every
handle restores the model exactly."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hf_longctx import ParallelismConfig
from hf_longctx.memory import apply_memory_flags, lm_head, offload, tiling
from hf_longctx.memory.lm_head import LogitTransform, linear_cross_entropy_sum, linear_token_stats
from hf_longctx.memory.tiled_mlp import auto_tiles, find_tiled_mlps
from tests._models import tiny_model

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
FLAGS = {
    "tiled_loss": {"tiled_loss": True},
    "tiled_mlp": {"tiled_mlp": 3},
    "tiled_mlp_auto": {"tiled_mlp": True},
    "offload": {"offload_activations": True},
    "all": {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True},
}
# (arch, attn): MHA/GQA dense, soft-capped logits + sliding windows, MoE with a shared expert and a
# dense first layer (MLA), MoE with a shared expert and chunked layers, MoE without dense MLPs (sinks).
ARCHS = [("llama", "sdpa"), ("gemma2", "eager"), ("deepseek_v3", "sdpa"), ("llama4", "sdpa"), ("gpt_oss", "eager")]


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    # 128-token vocab: 7 tokens per loss tile, so every test batch spans several tiles.
    monkeypatch.setattr(tiling, "TILE_LOGITS", 7 * 128)
    assert lm_head.tile_tokens(128) == 7  # the function the loss paths call sees the patched size


def _batch(shift: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (2, 37), generator=g)
    labels = ids.clone()
    labels[0, :20] = -100  # completion-only row
    labels[1, 30:] = -100  # right padding
    if shift:  # what hf_longctx's SP collator hands the model: labels = shift_labels, pre-shifted
        shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
        return {"input_ids": ids, "labels": shifted, "shift_labels": shifted}
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch, **kwargs):
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def _assert_same(out, grads, ref, ref_grads):
    assert abs(out.loss.item() - ref.loss.item()) <= LOSS_RTOL * abs(ref.loss.item())
    assert grads.keys() == ref_grads.keys()
    for name, r in ref_grads.items():
        err = (grads[name] - r).abs().max() / r.abs().max().clamp(min=1e-30)
        assert err <= GRAD_RTOL, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("arch,attn", ARCHS, ids=[a for a, _ in ARCHS])
def test_each_flag_matches_the_model_loss_and_gradients(arch, attn):
    model = tiny_model(arch, attn=attn, num_kv_heads=4 if arch == "deepseek_v3" else 2)  # MLA: one kv head per head
    for shift, num_items in ((False, None), (True, torch.tensor(31))):
        batch = _batch(shift)
        kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
        ref, ref_grads = _loss_and_grads(model, batch, **kwargs)
        for flags in FLAGS.values():
            with apply_memory_flags(model, SimpleNamespace(**flags)):
                out, grads = _loss_and_grads(model, batch, **kwargs)
            _assert_same(out, grads, ref, ref_grads)
            if flags.get("tiled_loss"):
                assert "logits" not in out  # a training forward never builds them


def test_eval_forward_returns_the_logits_and_the_same_loss():
    model = tiny_model("llama")
    batch = _batch(shift=False)
    with torch.no_grad():
        ref = model(**batch)
        with apply_memory_flags(model, SimpleNamespace(tiled_loss=True, tiled_mlp=True)):
            out = model(**batch)
            as_tuple = model(**batch, return_dict=False)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-6, atol=1e-6)
    assert abs(out.loss.item() - ref.loss.item()) <= LOSS_RTOL * ref.loss.item()
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], out.loss)


def test_remove_restores_the_model_exactly():
    model = tiny_model("llama")
    model.activation_checkpointing_enable({"use_reentrant": True})
    layer = model.model.layers[0]
    before = (
        dict(model.__dict__).get("forward"),
        layer.__dict__.get("_gradient_checkpointing_func"),
        layer.__dict__.get("gradient_checkpointing"),
        len(model._forward_pre_hooks),
        len(model.lm_head._forward_hooks),
        len(model.model._forward_hooks),
    )
    handle = apply_memory_flags(model, SimpleNamespace(**FLAGS["all"]))
    assert set(handle.parts) == {"tiled_loss", "tiled_mlp", "offload_activations"}
    assert "forward" in model.__dict__ and "forward" in layer.mlp.__dict__
    handle.remove()
    handle.remove()  # idempotent
    after = (
        dict(model.__dict__).get("forward"),
        layer.__dict__.get("_gradient_checkpointing_func"),
        layer.__dict__.get("gradient_checkpointing"),
        len(model._forward_pre_hooks),
        len(model.lm_head._forward_hooks),
        len(model.model._forward_hooks),
    )
    assert after[0] is before[0] is None and after[1] is before[1] and after[2:] == before[2:]
    assert "forward" not in layer.mlp.__dict__


def test_offload_keeps_layer_inputs_in_copies_and_prefetches_one_layer_ahead(monkeypatch):
    model = tiny_model("llama", layers=3)
    batch = _batch(shift=False)
    ref, ref_grads = _loss_and_grads(model, batch)
    events = []
    pack, fetch = offload.HostOffload._pack, offload.HostOffload._fetch

    def counting_pack(self, group, inputs, t):
        packed = pack(self, group, inputs, t)
        if isinstance(packed, offload._Saved):
            assert packed.host.data_ptr() != t.data_ptr()  # a separate copy holds the layer input
            events.append(("pack", id(group)))
        return packed

    def counting_fetch(self, group, wanted=None):
        if any(s.fetched is None and s.pending for s in group.saved.values()):
            events.append(("fetch", id(group)))
        return fetch(self, group, wanted)

    monkeypatch.setattr(offload.HostOffload, "_pack", counting_pack)
    monkeypatch.setattr(offload.HostOffload, "_fetch", counting_fetch)
    handle = offload.enable_offload_activations(model, always_copy=True)
    out, grads = _loss_and_grads(model, batch)
    handle.remove()
    _assert_same(out, grads, ref, ref_grads)
    packs = [g for kind, g in events if kind == "pack"]
    assert len(packs) == 3  # one hidden-state input per decoder layer, nothing else
    # Backward recomputes layer 3 first: fetching it also prefetches layer 2, then layer 1.
    assert [g for kind, g in events if kind == "fetch"] == packs[::-1]


def test_fused_head_outputs_equal_trls_kernel_and_trl_never_runs(monkeypatch):
    import trl.trainer.utils as trl_utils
    from trl.trainer.utils import add_fused_lm_head

    wanted = ("log_probs", "entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
    for arch, attn in (("llama", "sdpa"), ("gemma2", "eager")):
        model = tiny_model(arch, attn=attn)
        add_fused_lm_head(model, outputs=wanted)
        for shift in (False, True):
            batch = _batch(shift)
            results = []
            for flags in ({}, {"tiled_loss": True, "tiled_mlp": True}):
                calls = []
                original = trl_utils._ChunkedLogProbFunction.apply
                monkeypatch.setattr(
                    trl_utils._ChunkedLogProbFunction, "apply", lambda *a, _o=original, _c=calls: _c.append(1) or _o(*a)
                )
                with apply_memory_flags(model, SimpleNamespace(**flags)):
                    out = model(**batch, fused_lm_head=True, num_items_in_batch=torch.tensor(40))
                    (out.loss + 0.1 * out.entropy.sum()).backward()  # gradients through both outputs
                monkeypatch.undo()
                assert len(calls) == (0 if flags else 1)
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
                results.append((out, grads))
            (ref, ref_grads), (got, got_grads) = results
            for field in ("loss", *wanted, "label_mask"):
                assert got[field].shape == ref[field].shape and got[field].dtype == ref[field].dtype
                torch.testing.assert_close(got[field].float(), ref[field].float(), rtol=1e-5, atol=2e-6)
            for name, r in ref_grads.items():
                assert (got_grads[name] - r).abs().max() <= GRAD_RTOL * r.abs().max()


def test_linear_cross_entropy_matches_torch_with_bias_scale_softcap_and_ignored_rows():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(29, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    bias = torch.randn(50, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (29,), generator=g)
    labels[[0, 5, 28]] = -100
    for transform in (LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)):
        z = transform.apply(F.linear(hidden, weight, bias))
        ref = F.cross_entropy(z, labels, ignore_index=-100, reduction="sum")
        ref_grads = torch.autograd.grad(2 * ref, (hidden, weight, bias))
        got = linear_cross_entropy_sum(hidden, weight, bias, labels, transform, tile=4)
        got_grads = torch.autograd.grad(2 * got, (hidden, weight, bias))
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(got_grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        stats = linear_token_stats(hidden, weight, bias, labels, transform, tile=4)
        log_p = torch.log_softmax(z, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0].masked_fill(labels < 0, 0)
        torch.testing.assert_close(stats["log_probs"], log_p, rtol=1e-5, atol=1e-6)
    # No valid label: zero loss, zero (not NaN) gradients.
    none = torch.full((29,), -100)
    total = linear_cross_entropy_sum(hidden, weight, bias, none, tile=4)
    grads = torch.autograd.grad(total, (hidden, weight))
    assert total.item() == 0.0 and all(bool((g == 0).all()) for g in grads)


class LiveBytes(TorchDispatchMode):
    """The most bytes of storages created inside the block that were alive at once (after each aten op)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.live.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(size for _, size in self.live.values()))
        return out


def test_loss_tiles_hold_one_tile_of_logits_at_a_time():
    """A tile's [tokens, vocab] buffers are freed before the next tile's exist (the planner counts one tile)."""
    g = torch.Generator().manual_seed(0)
    n, hidden_size, vocab, tile = 96, 4, 4096, 16
    hidden = torch.randn(n, hidden_size, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=g)
    tile_bytes = tile * vocab * 4
    # Hidden-state and weight gradients (kept from forward), and one weight-gradient-sized matmul temporary.
    gradient_bytes = (n + 2 * vocab) * hidden_size * 4
    with LiveBytes() as mode:
        total = linear_cross_entropy_sum(hidden, weight, None, labels, tile=tile)
    assert mode.peak <= tile_bytes + gradient_bytes + tile_bytes // 4, (mode.peak, tile_bytes)
    total.backward()
    # TRL's fields: the tile's logits and their exp (two buffers) in forward and in backward.
    for phase in ("forward", "backward"):
        with LiveBytes() as mode:
            stats = linear_token_stats(hidden, weight, None, labels, tile=tile)
            if phase == "backward":
                mode.peak = 0
                (stats["log_probs"].sum() + stats["entropy"].sum()).backward()
        assert mode.peak <= 2 * tile_bytes + gradient_bytes + tile_bytes // 4, (phase, mode.peak, tile_bytes)


def test_unsupported_logits_raise_a_value_error_naming_the_flag():
    model = tiny_model("llama")
    model.config.logit_scale = 2.0  # the config now declares a scale the model's forward does not apply
    with apply_memory_flags(model, SimpleNamespace(tiled_loss=True)):
        with pytest.raises(ValueError, match="set tiled_loss=False"):
            model(**_batch(shift=False))


def test_tiled_mlp_finds_dense_and_shared_experts_and_logs_moe_blocks(caplog):
    with caplog.at_level(logging.INFO, logger="hf_longctx.memory.tiled_mlp"):
        handle = apply_memory_flags(tiny_model("deepseek_v3", num_kv_heads=4), SimpleNamespace(tiled_mlp=True))
    part = handle.parts["tiled_mlp"]
    assert part.modules == ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"]
    assert part.skipped == ["DeepseekV3MoE"]
    assert sum("DeepseekV3MoE" in r.message for r in caplog.records) == 1
    found, skipped = find_tiled_mlps(tiny_model("gpt_oss", attn="eager"))
    assert found == [] and skipped == ["GptOssMLP", "GptOssMLP"]
    assert auto_tiles(8192, 256) == 2 and auto_tiles(131072, 4096) == 32 and auto_tiles(10, 256) == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tiled_loss": "yes"}, "tiled_loss"),
        ({"offload_activations": 1}, "offload_activations"),
        ({"tiled_mlp": 0}, "tiled_mlp"),
        ({"tiled_mlp": -2}, "tiled_mlp"),
        ({"sp_size": 2, "sp_backend": "deepspeed", "tiled_loss": True}, "sp_backend"),
    ],
)
def test_bad_flags_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelismConfig(**kwargs)


def test_flags_on_the_config():
    config = ParallelismConfig(sp_size=2, tiled_loss=True, tiled_mlp=8, offload_activations=True)
    assert (config.tiled_loss, config.tiled_mlp, config.offload_activations) == (True, 8, True)
    assert config.memory_enabled and not ParallelismConfig().memory_enabled


def test_fused_head_defers_to_trl_when_its_settings_are_unreadable(monkeypatch):
    import trl.trainer.utils as trl_utils
    from trl.trainer.utils import add_fused_lm_head

    from hf_longctx import _compat

    model = tiny_model("llama")
    add_fused_lm_head(model, cast_lm_head_to_fp32=True)
    assert _compat.trl_fused_head_settings(model.forward)["cast_lm_head_to_fp32"] is True
    batch = _batch(shift=False)
    with apply_memory_flags(model, SimpleNamespace(tiled_loss=True)):
        ours = model(**batch, fused_lm_head=True)  # our tiles, float32 head as TRL was told
        calls = []
        original = trl_utils._ChunkedLogProbFunction.apply
        monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", lambda *a: calls.append(1) or original(*a))
        monkeypatch.setattr(_compat, "trl_fused_head_settings", lambda forward: None)
        theirs = model(**batch, fused_lm_head=True)
    assert calls == [1]
    torch.testing.assert_close(ours.log_probs, theirs.log_probs, rtol=1e-5, atol=1e-6)


def test_fused_head_in_float32_on_a_bfloat16_model_matches_trl():
    """`cast_lm_head_to_fp32=True` on bf16 weights: the head runs in float32 with the weight cast, as TRL's."""
    import trl.trainer.utils as trl_utils
    from trl.trainer.utils import add_fused_lm_head

    from hf_longctx import _compat

    batch = _batch(shift=False)
    results = []
    for ours in (True, False):
        model = tiny_model("llama").to(torch.bfloat16)
        add_fused_lm_head(model, cast_lm_head_to_fp32=True, outputs=("log_probs", "entropy"))
        calls = []
        original = trl_utils._ChunkedLogProbFunction.apply
        with pytest.MonkeyPatch.context() as mp:
            counted = lambda *a, _o=original, _c=calls: _c.append(1) or _o(*a)  # noqa: E731
            mp.setattr(trl_utils._ChunkedLogProbFunction, "apply", counted)
            if not ours:
                mp.setattr(_compat, "trl_fused_head_settings", lambda forward: None)
            with apply_memory_flags(model, SimpleNamespace(tiled_loss=True)):
                out = model(**batch, fused_lm_head=True)
                (out.loss + 0.1 * out.entropy.sum()).backward()
        assert calls == ([] if ours else [1])
        assert out.log_probs.dtype == torch.float32
        results.append((out, model.lm_head.weight.grad.float()))
    (got, got_grad), (ref, ref_grad) = results
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, ref_grad, rtol=2e-2, atol=1e-3)

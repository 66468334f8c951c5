"""`enable_sequence_parallel` in one process (SP=1, no process group): exactness and lifecycle.

With `SequenceParallelGroups.single()` the collectives are no-ops, so the SP path must reproduce
the plain model with an explicit document-causal mask, and `remove()` must restore it bit for bit.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hf_longctx import (
    IGNORE_INDEX,
    SequenceParallelGroups,
    SequenceParallelHandle,
    enable_sequence_parallel,
    sequence_parallel_loss,
    shard_batch,
)
from tests._models import tiny_model

SINGLE = SequenceParallelGroups.single()
ARCH_ATTN = [(arch, attn) for arch in ("llama", "qwen3", "mistral") for attn in ("sdpa", "eager")]
DOC_LENGTHS = (5, 4, 3)


def packed_batch(doc_lengths=DOC_LENGTHS, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sl = sum(doc_lengths)
    ids = torch.randint(1, 128, (1, sl), generator=gen)
    position_ids = torch.cat([torch.arange(n) for n in doc_lengths]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": position_ids, "labels": ids.clone()}


def document_causal_additive_mask(position_ids: torch.Tensor) -> torch.Tensor:
    doc = (position_ids == 0).cumsum(dim=1)
    idx = torch.arange(position_ids.shape[1])
    allowed = (idx[:, None] >= idx[None, :]) & (doc[:, :, None] == doc[:, None, :])
    zero = torch.zeros((), dtype=torch.float32)
    return torch.where(allowed, zero, torch.finfo(torch.float32).min).unsqueeze(1)  # [bs, 1, sl, sl]


def registry_keys() -> tuple[list[str], list[str]]:
    return list(ALL_ATTENTION_FUNCTIONS.keys()), list(ALL_MASK_ATTENTION_FUNCTIONS.keys())


def logits(model, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def assert_restored(model, keys_before, attn="sdpa"):
    assert model.config._attn_implementation == attn
    assert registry_keys() == keys_before
    assert len(model._forward_pre_hooks) == 0 and len(model._forward_hooks) == 0
    assert not hasattr(model, "_hf_longctx_sp_handle")


@pytest.mark.parametrize(("arch", "attn"), ARCH_ATTN)
def test_packed_row_matches_document_masked_reference(arch, attn):
    reference = tiny_model(arch, attn=attn).eval()
    model = tiny_model(arch, attn=attn).eval()
    batch = packed_batch()
    expected = logits(
        reference,
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=document_causal_additive_mask(batch["position_ids"]),
    )
    # Sensitivity check: plain causal attention across documents gives different logits.
    across = logits(
        reference,
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=torch.ones_like(batch["input_ids"]),
    )
    assert not torch.allclose(across, expected, atol=1e-3)

    with enable_sequence_parallel(model, SINGLE) as handle:
        assert model.config._attn_implementation == handle.key
        shard = shard_batch(batch, SINGLE)
        got = logits(model, input_ids=shard["input_ids"], position_ids=shard["position_ids"])
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)

        # The SP loss equals the single-device loss with document-aware shifted labels.
        model.train()
        loss = sequence_parallel_loss(model(**shard).logits, shard["shift_labels"], SINGLE)
    ids, labels, start = batch["input_ids"][0], [], 0
    for n in DOC_LENGTHS:
        labels += ids[start + 1 : start + n].tolist() + [IGNORE_INDEX]
        start += n
    want = F.cross_entropy(expected[0], torch.tensor(labels), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_right_padded_batch_matches_reference_on_real_tokens(attn):
    reference = tiny_model("llama", attn=attn).eval()
    model = tiny_model("llama", attn=attn).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 0, 0, 0]])
    mask = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 0, 0]])
    expected = logits(reference, input_ids=ids, attention_mask=mask)
    with enable_sequence_parallel(model, SINGLE):
        shard = shard_batch({"input_ids": ids, "attention_mask": mask, "labels": ids}, SINGLE)
        got = logits(model, **{k: v for k, v in shard.items() if k != "shift_labels"})
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_remove_restores_model_exactly(attn):
    never = tiny_model("llama", attn=attn)
    model = tiny_model("llama", attn=attn)
    keys_before = registry_keys()
    batch = packed_batch()
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}

    handle = enable_sequence_parallel(model, SINGLE)
    assert isinstance(handle, SequenceParallelHandle) and handle.active
    assert handle.key in ALL_ATTENTION_FUNCTIONS and handle.key in ALL_MASK_ATTENTION_FUNCTIONS
    assert len(model._forward_pre_hooks) == 1
    logits(model, **inputs)
    handle.remove()

    assert not handle.active and handle.context is None
    assert_restored(model, keys_before, attn)
    handle.remove()  # idempotent
    assert_restored(model, keys_before, attn)
    assert torch.equal(logits(model, **inputs), logits(never, **inputs))


def test_context_manager_restores_on_exit_and_on_error():
    model = tiny_model("qwen3")
    keys_before = registry_keys()
    with enable_sequence_parallel(model, SINGLE) as handle:
        assert handle.active
        assert model.config._attn_implementation == handle.key
    assert_restored(model, keys_before)

    with pytest.raises(RuntimeError, match="boom"):
        with enable_sequence_parallel(model, SINGLE):
            raise RuntimeError("boom")
    assert_restored(model, keys_before)


def test_second_enable_raises_and_enable_after_remove_works():
    model = tiny_model("llama")
    keys_before = registry_keys()
    handle = enable_sequence_parallel(model, SINGLE)
    keys_enabled = registry_keys()
    with pytest.raises(ValueError, match="already enabled"):
        enable_sequence_parallel(model, SINGLE)
    assert registry_keys() == keys_enabled  # the failed call registered nothing
    assert model.config._attn_implementation == handle.key
    handle.remove()
    assert_restored(model, keys_before)

    batch = packed_batch()
    with enable_sequence_parallel(model, SINGLE) as again:
        assert again.key != handle.key
        shard = shard_batch(batch, SINGLE)
        assert logits(model, input_ids=shard["input_ids"], position_ids=shard["position_ids"]).shape == (
            1,
            12,
            128,
        )
    assert_restored(model, keys_before)


def test_other_model_keeps_its_attention():
    other = tiny_model("llama", seed=1).eval()
    other_copy = tiny_model("llama", seed=1).eval()
    model = tiny_model("llama").eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    expected = logits(other_copy, input_ids=ids)
    with enable_sequence_parallel(model, SINGLE) as handle:
        logits(model, input_ids=ids, position_ids=torch.arange(6).unsqueeze(0))
        assert other.config._attn_implementation == "sdpa"
        assert other.config is not model.config
        assert torch.equal(logits(other, input_ids=ids), expected)  # no position_ids needed, no hook
        assert len(other._forward_pre_hooks) == 0
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not ALL_ATTENTION_FUNCTIONS[handle.key]


def test_unknown_backend_raises():
    model = tiny_model("llama")
    keys_before = registry_keys()
    with pytest.raises(ValueError, match=r"\['ulysses', 'ring', 'hybrid', 'auto'\]"):
        enable_sequence_parallel(model, SINGLE, backend="megatron")
    assert_restored(model, keys_before)


def test_unsupported_kernel_raises(monkeypatch):
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "hf_longctx_test_custom", ALL_ATTENTION_FUNCTIONS["sdpa"])
    model = tiny_model("llama", attn="hf_longctx_test_custom")
    keys_before = registry_keys()
    with pytest.raises(ValueError, match="not supported under sequence parallelism"):
        enable_sequence_parallel(model, SINGLE)
    assert_restored(model, keys_before, "hf_longctx_test_custom")


def test_heads_not_divisible_by_sp_size_raises_listing_valid_sizes():
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    keys_before = registry_keys()
    fake = dataclasses.replace(SINGLE, sp_world_size=3)
    with pytest.raises(ValueError, match=r"\[1, 2, 4\]"):
        enable_sequence_parallel(model, fake)
    assert_restored(model, keys_before)


def test_forward_without_position_ids_raises_naming_shard_batch():
    """Under SP (here a 2-rank view of one process: the check runs before any collective) a shard must come with
    its global positions; without SP (`SINGLE`) they are the row's own (tests/unit/test_single_attention.py)."""
    model = tiny_model("llama")
    two = SequenceParallelGroups(sp_group=None, sp_rank=0, sp_world_size=2, dp_group=None, dp_rank=0, dp_world_size=1)
    with enable_sequence_parallel(model, two):
        with pytest.raises(ValueError, match="shard_batch"):
            model(input_ids=torch.tensor([[1, 2, 3, 4]]))


def test_failure_during_enable_rolls_back(monkeypatch):
    model = tiny_model("mistral", attn="eager")
    keys_before = registry_keys()

    def broken(*args, **kwargs):
        raise RuntimeError("hook registration failed")

    monkeypatch.setattr(model, "register_forward_pre_hook", broken)
    with pytest.raises(RuntimeError, match="hook registration failed"):
        enable_sequence_parallel(model, SINGLE)
    assert_restored(model, keys_before, "eager")
    monkeypatch.undo()

    with enable_sequence_parallel(model, SINGLE):
        pass
    assert_restored(model, keys_before, "eager")


def test_activation_checkpointing_recompute_uses_its_own_forward_context():
    """Two forwards, then one backward (e.g. a two-pass preference loss) with checkpointed layers.

    The recomputation of the first forward must see the first batch's documents, not the last one's.
    """
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    positions = [packed_batch()["position_ids"], torch.arange(12).unsqueeze(0)]

    def grads(model, sp):
        model.activation_checkpointing_enable({"use_reentrant": False})
        outs = []
        for pos in positions:
            extra = {} if sp else {"attention_mask": document_causal_additive_mask(pos)}
            outs.append(model(input_ids=ids, position_ids=pos, **extra).logits)
        (outs[0].sum() + outs[1].square().mean()).backward()
        return [p.grad.clone() for p in model.parameters()]

    expected = grads(tiny_model("llama", attn="eager"), sp=False)
    model = tiny_model("llama", attn="eager")
    with enable_sequence_parallel(model, SINGLE):
        got = grads(model, sp=True)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize(
    ("model_type", "extra", "match"),
    [
        ("lfm2", {"layer_types": ["conv", "full_attention"]}, r"layers.0.conv \(layer type 'conv'\) is Lfm2ShortConv"),
        (
            "minimax",
            {"layer_types": ["full_attention", "linear_attention"], "num_local_experts": 2},
            r"layers.1.self_attn \(layer type 'linear_attention'\) is MiniMaxLightningAttention",
        ),
    ],
)
def test_token_mixing_outside_attention_is_refused(model_type, extra, match):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **TINY, head_dim=16, vocab_size=128, **extra)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    keys_before = registry_keys()
    with pytest.raises(ValueError, match=match) as err:
        enable_sequence_parallel(model, SINGLE)
    assert "sp_size=1" in str(err.value)
    assert_restored(model, keys_before)


def test_layer_that_skips_the_attention_interface_fails_the_forward():
    # The catch-all: a layer mixing tokens by some route the static check cannot see.
    model = tiny_model("llama")
    model.model.layers[1].self_attn.forward = lambda hidden_states, **kwargs: (torch.zeros_like(hidden_states), None)
    batch = shard_batch(packed_batch(), SINGLE)
    with enable_sequence_parallel(model, SINGLE):
        with pytest.raises(ValueError, match="Only 1 of 2 attention layers"):
            model(**batch)

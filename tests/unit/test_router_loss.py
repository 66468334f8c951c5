"""The MoE router load-balancing loss as hf_longctx computes it (`hf_longctx.sequence`), one process.

Every transformers family whose causal-LM forward adds the loss is found programmatically; for each one that builds
from the generic tiny recipe, the router modules hf_longctx hooks are the ones transformers records, and with the
SP handle on one rank (statistics accumulated layer by layer, transformers' recording off) the loss, `aux_loss` and
every gradient equal the plain model's, with a padded row. The SP=2 / SP=4 comparisons are in
tests/dist/test_sequence_ops.py.
"""

from __future__ import annotations

import pytest
import torch

from hf_longctx.attention.registry import enable_sequence_parallel
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.sequence.router_loss import RouterLoss
from hf_longctx.sequence.router_source import router_loss_source, router_modules
from tests._moe_models import REFUSED_MIXERS, UNBUILT, router_loss_families, tiny_moe

BUILT = [f for f in router_loss_families() if f not in UNBUILT]


def _batch(vocab: int = 128) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, vocab, (2, 19), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_every_router_loss_family_is_built_or_listed():
    families = router_loss_families()
    assert len(families) >= 25  # transformers 5.25 has 27 causal-LM families with the shared loss (and Doge's)
    assert set(UNBUILT) <= set(families), "a family listed as not built no longer adds a router loss"
    assert len(BUILT) >= 20


@pytest.mark.parametrize("family", BUILT)
def test_hooked_routers_are_the_ones_transformers_records(family):
    model = tiny_moe(family)
    seen: list[torch.Tensor] = []
    for module, index in router_modules(model):
        module.register_forward_hook(lambda m, a, out, i=index: seen.append(out[i] if isinstance(out, tuple) else out))
    out = model(**_batch())
    assert len(seen) == len(out.router_logits) > 0
    for ours, theirs in zip(seen, out.router_logits, strict=True):
        assert ours is theirs


@pytest.mark.parametrize("family", [f for f in BUILT if f not in REFUSED_MIXERS])
def test_layer_by_layer_statistics_give_transformers_loss_and_gradients(family):
    reference = tiny_moe(family)
    expected = reference(**_batch())
    expected.loss.backward()
    model = tiny_moe(family)
    handle = enable_sequence_parallel(model, SequenceParallelGroups.single())
    try:
        got = model(**_batch())
        got.loss.backward()
    finally:
        handle.remove()
    assert got.router_logits is None  # transformers kept none of them
    torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-6, atol=0)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        if theirs.grad is None:
            assert ours.grad is None, name
            continue
        scale = theirs.grad.abs().max().clamp(min=1e-12)
        assert (ours.grad - theirs.grad).abs().max() <= 1e-5 * scale, name


def test_checkpointed_layers_recompute_without_counting_twice():
    """Under non-reentrant activation checkpointing the routers run again in backward: their hooks must neither
    add to the finished forward's statistics nor upset the recomputation; the gradients stay transformers'."""
    reference = tiny_moe("qwen3_moe")
    reference.gradient_checkpointing_enable()
    reference(**_batch()).loss.backward()
    model = tiny_moe("qwen3_moe")
    model.gradient_checkpointing_enable()
    with enable_sequence_parallel(model, SequenceParallelGroups.single()):
        model(**_batch()).loss.backward()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)


def test_loss_off_leaves_transformers_in_charge():
    """With `output_router_logits=False` in the call nothing is taken over (no aux loss, as transformers)."""
    model = tiny_moe("mixtral")
    with enable_sequence_parallel(model, SequenceParallelGroups.single()):
        out = model(**_batch(), output_router_logits=False)
    assert out.aux_loss is None and out.router_logits is None


def test_a_different_router_loss_is_refused_by_name():
    """Doge's loss (product keys) is not transformers' shared one: refused when on, never computed wrongly."""
    from transformers import DogeForCausalLM

    source = router_loss_source(DogeForCausalLM)
    assert source is not None and source.refusal is not None
    loss = RouterLoss(torch.nn.Linear(2, 2), source)
    model = type("M", (), {"config": type("C", (), {"output_router_logits": True})()})()
    loss._model = lambda: model
    with pytest.raises(ValueError, match="output_router_logits=False.*sp_size=1"):
        loss.begin({"output_router_logits": True}, torch.ones(4))

"""`sequence_parallel_loss` at SP=1 (`SequenceParallelGroups.single()`): the token-mean cross-entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_longctx import IGNORE_INDEX, SequenceParallelGroups, sequence_parallel_loss

SINGLE = SequenceParallelGroups.single()
X = IGNORE_INDEX


def make_inputs(seed=0, bs=2, sl=7, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, sl, vocab, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (bs, sl), generator=gen)
    labels[0, :3] = X
    labels[1, -2:] = X
    return logits, labels


def test_equals_mean_cross_entropy_over_valid_labels():
    logits, labels = make_inputs()
    loss = sequence_parallel_loss(logits, labels, SINGLE)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=X)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)

    (grad,) = torch.autograd.grad(loss, logits)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=1e-6)


def test_low_precision_logits_are_upcast():
    logits, labels = make_inputs()
    loss = sequence_parallel_loss(logits.detach().bfloat16(), labels, SINGLE)
    want = F.cross_entropy(logits.detach().bfloat16().float().flatten(0, 1), labels.flatten(), ignore_index=X)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)


def test_all_labels_ignored_gives_exact_zero_and_zero_grads():
    logits, _ = make_inputs()
    labels = torch.full((2, 7), X)
    loss = sequence_parallel_loss(logits, labels, SINGLE)
    assert loss.item() == 0.0
    loss.backward()
    assert logits.grad is not None
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("num_items", [23, torch.tensor(23), torch.tensor(23, dtype=torch.int32)])
def test_num_items_in_batch_is_the_denominator(num_items):
    logits, labels = make_inputs()
    loss = sequence_parallel_loss(logits, labels, SINGLE, num_items_in_batch=num_items)
    summed = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=X, reduction="sum")
    torch.testing.assert_close(loss, summed / 23, atol=1e-6, rtol=1e-6)
    assert int((labels != X).sum()) != 23  # the given count wins over the local one

    (grad,) = torch.autograd.grad(loss, logits)
    (want_grad,) = torch.autograd.grad(summed / 23, logits)
    torch.testing.assert_close(grad, want_grad, atol=1e-7, rtol=1e-6)


def test_num_items_with_all_labels_ignored_is_zero():
    logits, _ = make_inputs()
    loss = sequence_parallel_loss(logits, torch.full((2, 7), X), SINGLE, num_items_in_batch=5)
    assert loss.item() == 0.0


@pytest.mark.parametrize("labels_shape", [(2, 6), (1, 7), (14,), (2, 7, 1)])
def test_shape_mismatch_raises(labels_shape):
    logits, _ = make_inputs()
    with pytest.raises(ValueError, match="disagree"):
        sequence_parallel_loss(logits, torch.zeros(labels_shape, dtype=torch.long), SINGLE)

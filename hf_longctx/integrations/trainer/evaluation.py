"""Evaluation under SP: `prediction_step` outputs become what a run without SP returns.

Each rank's `prediction_step` sees its slice of the sequence, so its loss, logits and labels are
partial. `full_prediction` merges them over the SP group once per call: the loss is summed from
token-weighted shares, per-token tensors (logits, labels) are gathered along the sequence and cut
back to the batch's real length, and the labels are the unshifted ones the collator kept. Every SP
rank then holds the DP rank's values, so the Trainer's evaluation loop gathers them over the DP
group only (`metrics.gather_replicated`), pads whole sequences across ranks and applies its own
remainder rule, exactly as without SP. A trainer whose own SP path already computes whole-sequence values on
every SP rank (RewardTrainer's pooled scores, GRPOTrainer's gathered log-probs) gets `replicated_prediction`:
its outputs are kept and gathered over the DP group only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from hf_longctx.data.consistency import ORIGINAL_LABELS_KEY, SIGNATURE_KEY
from hf_longctx.data.layout import to_global_order
from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.distributed.comm import all_gather_sequence, all_reduce_sum
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.trainer.metrics import gather_replicated
from hf_longctx.integrations.trainer.state import _unwrap
from hf_longctx.sequence.heads import QUESTION_ANSWERING, TOKEN_CLASSIFICATION, head_of


@contextlib.contextmanager
def observe_num_items(trainer: Any) -> Iterator[dict[str, Any]]:
    """Record the `num_items_in_batch` that `prediction_step` hands to `compute_loss` (transformers 5.x
    passes the global count; TRL's override passes none), which decides what the returned loss means."""
    seen: dict[str, Any] = {}
    previous = trainer.__dict__.get("compute_loss")
    compute_loss = trainer.compute_loss

    def recording(*args: Any, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        seen["num_items"] = num_items_in_batch
        return compute_loss(*args, num_items_in_batch=num_items_in_batch, **kwargs)

    trainer.compute_loss = recording
    try:
        yield seen
    finally:
        if previous is None:
            del trainer.compute_loss
        else:
            trainer.compute_loss = previous


def _loss_share(trainer: Any, groups: SequenceParallelGroups, inputs: dict, loss: torch.Tensor, seen: dict) -> Any:
    """This rank's share of its DP rank's loss: the shares of an SP group sum to the loss without SP."""
    if head_of(_unwrap(trainer.model))[0] in (TOKEN_CLASSIFICATION, QUESTION_ANSWERING):
        # hf_longctx took these heads' losses over the whole row (`sequence/head_losses.py`): P x each rank's share
        # of a token-classification mean (times what Trainer multiplies by), a QA loss whole on every rank.
        return loss / groups.sp_world_size
    if seen.get("num_items") is not None and trainer.args.average_tokens_across_devices:
        # compute_loss returned world * (shard sum) / (global count): every rank is an equal share.
        return loss / groups.sp_world_size
    # compute_loss returned the shard's token mean: weight it by the shard's share of the tokens.
    count = (inputs["shift_labels"] != IGNORE_INDEX).sum().to(loss.device, torch.float64)
    total = all_reduce_sum(count, groups.sp_group)
    share = torch.where(count > 0, loss.detach().to(torch.float64) * count, 0.0) / total.clamp(min=1)
    return share.to(loss.dtype)


def _gather_tokens(value: Any, shard_len: int, length: int | None, groups: SequenceParallelGroups) -> Any:
    """Per-token tensors `[bs, shard_len, ...]` gathered along the sequence and cut to `length`."""
    if isinstance(value, (tuple, list)):
        return type(value)(_gather_tokens(v, shard_len, length, groups) for v in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != shard_len:
        return value
    # Shards arrive in rank order; a zigzag layout (ring, hybrid) puts them back in sequence order.
    full = to_global_order(
        all_gather_sequence(value.contiguous(), groups.sp_group, dim=1), groups.layout, groups.sp_world_size
    )
    return full[:, :length] if length is not None else full


def _gather_over_dp(trainer: Any, groups: SequenceParallelGroups) -> None:
    # What the evaluation loop gathers with (it resets it when it ends): the DP-only gather of replicated values.
    trainer.gather_function = functools.partial(
        gather_replicated, trainer.accelerator, groups, use_gather_object=trainer.args.eval_use_gather_object
    )


def replicated_prediction(trainer: Any, groups: SequenceParallelGroups, outputs: tuple) -> tuple[Any, Any, Any]:
    """`prediction_step` outputs that are already the DP rank's whole-batch values on every SP rank.

    The SP gather (`metrics.gather_for_metrics`) would sum the 1-d loss over the SP group, so the evaluation
    loop gathers these over the DP group only.
    """
    _gather_over_dp(trainer, groups)
    return outputs


def full_prediction(
    trainer: Any, groups: SequenceParallelGroups, inputs: dict, outputs: tuple, seen: dict
) -> tuple[Any, Any, Any]:
    """`(loss, logits, labels)` of the DP rank's whole batch from this rank's `prediction_step` outputs.

    Also points `trainer.gather_function` (what the evaluation loop gathers with; the loop resets it
    when it ends) at the DP-only gather, and, when the Trainer passes inputs to `compute_metrics`
    (`include_for_metrics=["inputs"]`), puts the whole sequence back into `inputs`.
    """
    loss, logits, labels = outputs
    signature = inputs.get(SIGNATURE_KEY)
    if not isinstance(signature, torch.Tensor):
        return outputs  # not a batch of our collator: nothing is sharded
    if loss is not None:
        loss = all_reduce_sum(_loss_share(trainer, groups, inputs, loss, seen), groups.sp_group)
    length = int(signature[2])  # the batch's sequence length before SP padding
    shard_len = inputs["position_ids"].shape[1]
    logits = _gather_tokens(logits, shard_len, length, groups)
    if isinstance(labels, torch.Tensor) and list(trainer.label_names) == ["labels"] and ORIGINAL_LABELS_KEY in inputs:
        labels = inputs[ORIGINAL_LABELS_KEY]
    labels = _gather_tokens(labels, shard_len, length, groups)
    main_input = getattr(trainer.model, "main_input_name", "input_ids")
    if "inputs" in (trainer.args.include_for_metrics or []) and main_input in inputs:
        inputs[main_input] = _gather_tokens(inputs[main_input], shard_len, length, groups)
    _gather_over_dp(trainer, groups)
    return loss, logits, labels

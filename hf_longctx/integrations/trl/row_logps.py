"""Per-row completion log-probabilities under SP, shared by the preference trainers' SP paths (`dpo.py`, `kto.py`).

DPO's and KTO's losses are functions of per-row sums: each row's summed log-probability of its completion,
under the policy and under the reference. Their rows are sharded along the sequence like SFT rows, so a rank
holds only part of each sum. `row_sums` is the main entry: it runs TRL's fused LM head on the shard and adds
each row's partial sum over the SP group with `comm.group_sum` (its backward hands each rank the gradient of
its own tokens, pre-scaled for the engine's average over all ranks), so every SP rank holds the DP rank's
whole values and computes the same loss and metrics.

The targets (the next token inside the completion, -100 elsewhere) are built on the FULL sequence, before
hf_longctx shards it (`completion_targets`), under a key of their own: a `labels` key would make the Trainer
count `num_items_in_batch` and change its gradient-accumulation scaling. Also here: the reference forward as
TRL picks it (`reference_forward`), the per-token metrics both trainers log (`log_token_metrics`) and TRL's MoE
router loss term (`add_router_loss`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hf_longctx.data.sharding import IGNORE_INDEX, make_shift_labels
from hf_longctx.distributed.comm import group_sum
from hf_longctx.integrations.trainer.metrics import gather_replicated
from hf_longctx.integrations.trainer.state import SequenceParallelState

TARGETS_KEY = "hf_longctx_completion_targets"


@dataclass
class RowSums:
    """One forward's per-row log-prob sums over the whole sequence (the same on every SP rank), and its shard."""

    logps: torch.Tensor  # [rows] summed completion log-probs (differentiable for the policy)
    outputs: Any  # this shard's `FusedCausalLMOutput`
    mask: torch.Tensor  # [rows, shard] positions of this shard whose next token is scored


def completion_targets(input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """`[rows, seq]` targets on the full sequence: position t scores token t+1 when that token is in the completion.

    Built before sharding, so a shard's last position scores the next shard's first token; TRL scores the same
    positions (`labels` = the completion tokens, shifted inside its fused LM head).
    """
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)  # one row each
    return make_shift_labels(input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX), positions)


def shard_sums(
    state: SequenceParallelState, model: Any, kwargs: dict[str, Any], targets: torch.Tensor, aux: bool = False
) -> RowSums:
    """This shard's per-row partial sums (not yet reduced over the SP group) from `model(**kwargs)` with the fused
    LM head; with `aux` the forward also computes the MoE router loss (`outputs.aux_loss`, whole on every SP rank).
    """
    # A reference TRL prepared itself (DeepSpeed, FSDP) or a policy not prepared yet (TRL's precompute) gets SP
    # attention before its first sharded forward (idempotent; `enable_sequence_parallel` validates the model).
    state.enable(model)
    # The SP padding (attention 0) carries target 0 from the sharding's fill: it scores nothing.
    targets = targets.masked_fill(kwargs["attention_mask"] == 0, IGNORE_INDEX)
    if aux:
        kwargs = {**kwargs, "output_router_logits": True}  # as TRL asks for the policy forward
    outputs = model(**kwargs, shift_labels=targets, fused_lm_head=True, use_cache=False)
    return RowSums(outputs.log_probs.sum(dim=1), outputs, targets != IGNORE_INDEX)


def row_sums(
    state: SequenceParallelState, model: Any, kwargs: dict[str, Any], targets: torch.Tensor, aux: bool = False
) -> RowSums:
    """`shard_sums` with each row's sum added over the SP group: the whole row's log-prob on every SP rank."""
    rows = shard_sums(state, model, kwargs, targets, aux)
    groups = state.groups
    rows.logps = group_sum(rows.logps, groups.sp_group, groups.sp_world_size)
    return rows


def adapter_disabled(trainer: Any) -> contextlib.AbstractContextManager:
    """TRL's reference for a PEFT policy without a reference model: the policy with its adapter disabled (or
    TRL's "ref" adapter, a copy of a pretrained one); otherwise nothing to switch."""
    from accelerate.utils import is_peft_model
    from trl.trainer.utils import use_adapter

    if trainer.ref_model is not None or not is_peft_model(trainer.model):
        return contextlib.nullcontext()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)


@contextlib.contextmanager
def reference_forward(trainer: Any) -> Iterator[Any]:
    """Yield the model whose forwards give the reference log-probs, as TRL picks it, with gradients and
    gradient checkpointing off: the reference model, or the PEFT policy without its adapter.

    Raises:
        ValueError: no reference model, no PEFT adapter (and so no precomputed log-probs either).
    """
    from accelerate.utils import is_peft_model
    from trl.models.utils import disable_gradient_checkpointing

    if trainer.ref_model is None and not is_peft_model(trainer.model):
        raise ValueError(f"{type(trainer).__name__} has no reference model and no precomputed reference log-probs.")
    checkpointing = disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)
    with torch.no_grad(), checkpointing, adapter_disabled(trainer):
        yield trainer.model if trainer.ref_model is None else trainer.ref_model


def token_total(trainer: Any, x: torch.Tensor) -> torch.Tensor:
    """A per-shard partial sum totalled over the SP group and then the DP ranks (hf_longctx's `gather_for_metrics`
    adds 0-d values over the SP group before its DP gather)."""
    return trainer.accelerator.gather_for_metrics(x).sum()


def log_token_metrics(trainer: Any, inputs: dict[str, Any], policy: RowSums) -> None:
    """TRL's per-token metrics `entropy` (over scored completion tokens) and `num_tokens`, from shard sums."""
    mode = "train" if trainer.model.training else "eval"
    metrics = trainer._metrics[mode]
    tokens = token_total(trainer, policy.mask.sum())
    entropy = token_total(trainer, (policy.outputs.entropy.detach() * policy.mask).sum())
    metrics["entropy"].append((entropy / tokens).item() if tokens > 0 else 0.0)
    if mode == "train":
        trainer._total_train_tokens += token_total(trainer, inputs["attention_mask"].sum()).item() // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]


def mean_logits(trainer: Any, policy: RowSums, rows: torch.Tensor) -> tuple[float, float]:
    """(total, count) over the DP ranks of the mean-over-vocabulary logit at the scored tokens of `rows` (bool)."""
    mask = policy.mask & rows.unsqueeze(1)
    total = token_total(trainer, policy.outputs.mean_logits.detach()[mask].sum())
    return total.item(), token_total(trainer, mask.sum()).item()


def add_router_loss(trainer: Any, state: SequenceParallelState, loss: torch.Tensor, policy: RowSums) -> torch.Tensor:
    """TRL's `loss + router_aux_loss_coef * aux_loss` with the policy forward's MoE router loss, and its `aux_loss`
    metric: TRL's mean over every process, here over the DP ranks.

    The router loss is whole on every SP rank (`hf_longctx.sequence`). Its replicated mark does not survive DDP
    when DDP clones the forward's outputs (`find_unused_parameters`, e.g. LoRA on a MoE), so it is gathered over
    the DP group explicitly rather than through `gather_for_metrics`.
    """
    aux = policy.outputs.aux_loss
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode]["aux_loss"].append(gather_replicated(trainer.accelerator, state.groups, aux).mean().item())
    return loss + trainer.router_aux_loss_coef * aux

"""TRL `DPOTrainer` under hf_longctx SP: each row's summed log-probability is reduced over the SP group.

DPO's loss is a function of per-row sums, the log-probability of the chosen and of the rejected
completion under the policy and under the reference. The concatenated chosen+rejected batch is sharded
along the sequence like SFT rows, so every rank sums the fused LM head's per-token log-probs of its own
shard and the partial sums are added over the SP group (`comm.group_sum`: its backward hands each rank
the gradient of its own tokens, pre-scaled for the engine's average over all ranks) before any loss is
formed. Every SP rank then holds its DP rank's full per-pair values and computes the same loss, rewards
and log-prob metrics; per-token metrics (entropy, mean logits, token accuracy, token counts) stay
per-shard partial sums, which hf_longctx's `gather_for_metrics` adds over the SP group.

The targets (the next token inside the completion, -100 elsewhere) are built by a collator wrapper on
the FULL sequence, before hf_longctx shards it, under a key of their own: a `labels` key would make the
Trainer count `num_items_in_batch` and change its gradient-accumulation scaling. The reference
log-probs come from a separate reference model, from the PEFT policy with its adapter disabled (or
TRL's "ref" adapter), or precomputed by TRL; every reference forward runs on the same shard through the
same SP path. The losses (every TRL 1.16 `loss_type`, the f-divergences, WPO weighting) are computed
from the reduced per-row values in `dpo_losses.py`, and TRL's MoE router loss from the policy forward
(`hf_longctx.sequence`); what is not (`ld_alpha`, vision-language models) is refused at construction, by name
(`check_dpo_settings`). TRL 1.16 itself turns
`padding_free` off, so there is no packed DPO to support.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.data.sharding import IGNORE_INDEX, make_shift_labels
from hf_longctx.distributed.comm import all_reduce_sum, group_sum
from hf_longctx.integrations.trainer.state import SequenceParallelState
from hf_longctx.integrations.trl.dpo_losses import F_DIVERGENCES, LOSS_TYPES, Pairs, pair_losses
from hf_longctx.integrations.trl.errors import UnsupportedSetup

TARGETS_KEY = "hf_longctx_dpo_targets"
_NOT_MODEL_INPUTS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps", TARGETS_KEY)


@dataclass
class RowSums:
    """One forward's per-row values over the whole sequence (the same on every SP rank), and its shard."""

    logps: torch.Tensor  # [2B] summed completion log-probs (differentiable for the policy)
    scored: torch.Tensor  # [2B] scored completion tokens (completion positions after the first)
    completion: torch.Tensor  # [2B] completion tokens (TRL's `completion_mask.sum(1)`)
    outputs: Any  # this shard's `FusedCausalLMOutput`
    mask: torch.Tensor  # [2B, shard] positions of this shard whose next token is scored


def check_dpo_settings(trainer: Any) -> None:
    """Refuse, by name, the DPOTrainer options this SP path does not compute exactly.

    Raises:
        UnsupportedSetup: naming the option and what works.
    """
    for loss_type in trainer.loss_types:
        if loss_type not in LOSS_TYPES:
            raise UnsupportedSetup(
                f"its loss_type={loss_type!r} has no exact SP path in hf_longctx (loss types that work under SP: "
                f"{', '.join(LOSS_TYPES)})"
            )
    refused = {
        f"f_divergence_type={trainer.f_divergence_type!r}": (
            trainer.f_divergence_type not in F_DIVERGENCES,
            f"f_divergence_type in {F_DIVERGENCES}",
        ),
        # Its weights depend on each token's position in the completion, counted across the shards.
        "ld_alpha": (trainer.ld_alpha is not None, "ld_alpha=None"),
        "a vision dataset or processor": (trainer._is_vision_dataset or trainer._is_vlm, "a text-only model"),
    }
    for option, (bad, works) in refused.items():
        if bad:
            raise UnsupportedSetup(f"{option} has no exact SP path in hf_longctx (works under SP: {works})")


def _with_targets(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], dict[str, Any]]:
    def collate_with_targets(features: list[Any]) -> dict[str, Any]:
        batch = dict(collate(features))
        if "completion_mask" not in batch:
            raise ValueError(
                "DPOTrainer under SP scores the completion tokens the collator marks: its batches need "
                "`completion_mask` (TRL's DataCollatorForPreference provides it); got keys " + ", ".join(batch)
            )
        ids, completion = batch["input_ids"], batch["completion_mask"]
        # Position t scores token t+1, on the full sequence: a shard's last position scores the next shard's first.
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)  # one pair side per row
        batch[TARGETS_KEY] = make_shift_labels(ids.masked_fill(completion == 0, IGNORE_INDEX), positions)
        return batch

    return collate_with_targets


def row_sums(state: SequenceParallelState, model: Any, inputs: dict[str, Any], aux: bool = False) -> RowSums:
    """Run `model` on the shard with the fused LM head and reduce each row's sums over the SP group; with `aux` the
    forward also computes the MoE router loss (`outputs.aux_loss`, whole on every SP rank)."""
    # A reference TRL prepared itself (DeepSpeed, FSDP) or a policy not prepared yet (TRL's precompute) gets SP
    # attention before its first sharded forward (idempotent; `enable_sequence_parallel` validates the model).
    state.enable(model)
    groups = state.groups
    # The SP padding (attention 0) carries target 0 from the sharding's fill: it scores nothing.
    targets = inputs[TARGETS_KEY].masked_fill(inputs["attention_mask"] == 0, IGNORE_INDEX)
    kwargs = {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}
    if aux:
        kwargs["output_router_logits"] = True  # as TRL asks for the policy forward
    outputs = model(**kwargs, shift_labels=targets, fused_lm_head=True, use_cache=False)
    mask = targets != IGNORE_INDEX
    logps = group_sum(outputs.log_probs.sum(dim=1), groups.sp_group, groups.sp_world_size)
    counts = all_reduce_sum(torch.stack([mask.sum(dim=1), inputs["completion_mask"].sum(dim=1)]), groups.sp_group)
    return RowSums(logps, counts[0], counts[1], outputs, mask)


def _reference(trainer: Any, state: SequenceParallelState, inputs: dict[str, Any]) -> RowSums:
    """The reference forward, as TRL picks it: the reference model, or the PEFT policy without its adapter."""
    from accelerate.utils import is_peft_model
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    args = trainer.args
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, args.gradient_checkpointing_kwargs):
        if trainer.ref_model is None and is_peft_model(trainer.model):
            unwrapped = trainer.accelerator.unwrap_model(trainer.model)
            with use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                return row_sums(state, trainer.model, inputs)
        if trainer.ref_model is None:
            raise ValueError("DPOTrainer has no reference model and no precomputed reference log-probs.")
        return row_sums(state, trainer.ref_model, inputs)


def _log_metrics(trainer: Any, inputs: dict[str, Any], policy: RowSums, ratios: tuple, logps: tuple) -> None:
    """TRL's DPO metrics: per-token ones from this shard's partial sums, per-pair ones from full values."""
    mode = "train" if trainer.model.training else "eval"
    metrics, acc = trainer._metrics[mode], trainer.accelerator

    def total(x: torch.Tensor) -> torch.Tensor:  # over the SP group (partial sums), then over DP
        return acc.gather_for_metrics(x).sum()

    out, mask = policy.outputs, policy.mask
    tokens = total(mask.sum())
    entropy = total((out.entropy.detach() * mask).sum())
    metrics["entropy"].append((entropy / tokens).item() if tokens > 0 else 0.0)
    if mode == "train":
        trainer._total_train_tokens += total(inputs["attention_mask"].sum()).item() // trainer._tp_size
    metrics["num_tokens"] = [trainer._total_train_tokens]
    chosen_mask, rejected_mask = (m.bool() for m in mask.chunk(2))
    chosen_logits, rejected_logits = out.mean_logits.chunk(2)
    for name, logits, m in (("chosen", chosen_logits, chosen_mask), ("rejected", rejected_logits, rejected_mask)):
        count = total(m.sum()).item()
        metrics[f"logits/{name}"].append(total(logits[m].sum()).item() / count if count > 0 else 0.0)
    correct, count = total((out.is_top1.chunk(2)[0] & chosen_mask).sum()), total(chosen_mask.sum())
    metrics["mean_token_accuracy"].append((correct / count).item() if count > 0 else 0.0)
    # Full per-pair values, repeated on every SP rank: gathered over all ranks, their means are the DP means.
    chosen_rewards, rejected_rewards = (trainer.beta * r.detach() for r in ratios)
    metrics["rewards/chosen"].append(acc.gather(chosen_rewards).mean().item())
    metrics["rewards/rejected"].append(acc.gather(rejected_rewards).mean().item())
    metrics["rewards/accuracies"].append(acc.gather((chosen_rewards > rejected_rewards).float()).mean().item())
    metrics["rewards/margins"].append(acc.gather(chosen_rewards - rejected_rewards).mean().item())
    metrics["logps/chosen"].append(acc.gather(logps[0].detach()).mean().item())
    metrics["logps/rejected"].append(acc.gather(logps[1].detach()).mean().item())


def _wpo_weights(state: SequenceParallelState, policy: RowSums) -> torch.Tensor:
    """WPO's per-pair weight (`use_weighting`): exp of each row's mean aligned log-prob, chosen x rejected."""
    out = policy.outputs
    with torch.no_grad():
        aligned = ((out.log_probs - out.log_sum_sq_probs) * policy.mask).sum(dim=1)
        mean = all_reduce_sum(aligned, state.groups.sp_group) / policy.scored.clamp(min=1)
    chosen, rejected = torch.exp(mean).chunk(2)
    return chosen * rejected


def _make_compute_loss(trainer: Any, state: SequenceParallelState):
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _compute_loss(model, inputs, return_outputs):
            policy = row_sums(state, model, inputs, aux=trainer.aux_loss_enabled)
            if trainer.precompute_ref_logps:
                ref = (inputs["ref_chosen_logps"], inputs["ref_rejected_logps"])
            else:
                ref = _reference(trainer, state, inputs).logps.chunk(2)
            pairs = Pairs(
                *policy.logps.chunk(2), *ref, *policy.completion.chunk(2), chosen_scored=policy.scored.chunk(2)[0]
            )
            losses = pair_losses(
                pairs,
                trainer.beta,
                trainer.label_smoothing,
                trainer.args.discopop_tau,
                trainer.f_divergence_type,
                trainer.f_alpha_divergence_coef,
            )
            weight = _wpo_weights(state, policy) if trainer.use_weighting else 1.0
            loss = 0.0
            for loss_type, loss_weight in zip(trainer.loss_types, trainer.loss_weights, strict=True):
                loss = loss + (losses[loss_type]() * weight).mean() * loss_weight
            ratios = (pairs.chosen - pairs.ref_chosen, pairs.rejected - pairs.ref_rejected)
            _log_metrics(trainer, inputs, policy, ratios, (pairs.chosen, pairs.rejected))
            if trainer.aux_loss_enabled:  # TRL: loss + coef * aux_loss, logged as the mean over processes
                aux = policy.outputs.aux_loss
                loss = loss + trainer.router_aux_loss_coef * aux
                mode = "train" if trainer.model.training else "eval"
                trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux).mean().item())
            if not return_outputs:
                return loss
            with torch.no_grad():  # evaluation's logits (TRL recomputes them too); merged over SP by prediction_step
                kwargs = {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}
                return loss, model(**kwargs, use_cache=False)

        return _compute_loss

    return make


def _make_ref_log_probs(trainer: Any, state: SequenceParallelState):
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_ref_log_probs(model, inputs):
            # TRL's precompute gathers the result with `gather_for_metrics`, which under SP adds 1-d values over
            # the SP group: return this shard's partial sums, the gather makes them whole.
            from accelerate.utils import is_peft_model
            from trl.trainer.utils import use_adapter

            context = contextlib.nullcontext()
            if trainer.ref_model is None and is_peft_model(trainer.model):
                unwrapped = trainer.accelerator.unwrap_model(trainer.model)
                context = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
            with torch.no_grad(), context, trainer.accelerator.autocast():
                rows = row_sums(state, model, inputs)
            return rows.outputs.log_probs.sum(dim=1).chunk(2)

        return compute_ref_log_probs

    return make


def setup_dpo(trainer: Any, state: SequenceParallelState) -> Callable[[], None]:
    """Patch one `DPOTrainer` instance for SP (idempotent); returns the undo.

    Runs inside `Trainer.__init__` (`_validate_args`): the data collator is set, the reference model and
    TRL's fused LM head are not yet, and are looked up at every step.

    Raises:
        UnsupportedSetup: an option without an exact SP path (see `check_dpo_settings`).
    """
    check_dpo_settings(trainer)
    patches = [
        Patch(trainer, "data_collator", _with_targets),
        Patch(trainer, "_compute_loss", _make_compute_loss(trainer, state)),
        Patch(trainer, "compute_ref_log_probs", _make_ref_log_probs(trainer, state)),
    ]
    for patch in patches:
        patch.apply()
    state.replicated_outputs = True  # loss and metrics come from the SP-reduced per-row sums: whole on every rank

    def undo() -> None:
        for patch in reversed(patches):  # the collator is restored, the methods fall back to the class's
            patch.remove()

    return undo

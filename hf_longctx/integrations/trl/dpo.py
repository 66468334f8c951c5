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
the FULL sequence, before hf_longctx shards it (`row_logps.completion_targets`). The reference
log-probs come from a separate reference model, from the PEFT policy with its adapter disabled (or
TRL's "ref" adapter), or precomputed by TRL; every reference forward runs on the same shard through the
same SP path (`row_logps.py`, shared with KTO). The losses (every TRL 1.16 `loss_type`, the f-divergences,
WPO weighting) are computed from the reduced per-row values in `dpo_losses.py`, and TRL's MoE router loss
from the policy forward (`hf_longctx.sequence`); what is not (`ld_alpha`, vision-language models) is
refused at construction, by name (`check_dpo_settings`). TRL 1.16 itself turns `padding_free` off, so
there is no packed DPO to support.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.distributed.comm import all_reduce_sum
from hf_longctx.integrations.trainer.state import SequenceParallelState
from hf_longctx.integrations.trl.dpo_losses import F_DIVERGENCES, LOSS_TYPES, Pairs, pair_losses
from hf_longctx.integrations.trl.errors import UnsupportedSetup
from hf_longctx.integrations.trl.row_logps import (
    TARGETS_KEY,
    RowSums,
    adapter_disabled,
    add_router_loss,
    completion_targets,
    log_token_metrics,
    mean_logits,
    reference_forward,
    row_sums,
    shard_sums,
    token_total,
)

_NOT_MODEL_INPUTS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps", TARGETS_KEY)


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
        # The logits TRL recomputes for it (deprecated in TRL 1.16) would be each rank's slice of the sequence.
        "compute_metrics": (trainer.compute_metrics is not None, "compute_metrics=None; DPO's own metrics are exact"),
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
        batch[TARGETS_KEY] = completion_targets(batch["input_ids"], batch["completion_mask"])  # one side per row
        return batch

    return collate_with_targets


def _model_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}


def _log_metrics(trainer: Any, inputs: dict[str, Any], policy: RowSums, ratios: tuple, logps: tuple) -> None:
    """TRL's DPO metrics: per-token ones from this shard's partial sums, per-pair ones from full values."""
    mode = "train" if trainer.model.training else "eval"
    metrics, acc = trainer._metrics[mode], trainer.accelerator
    log_token_metrics(trainer, inputs, policy)
    chosen_rows = torch.arange(policy.mask.shape[0], device=policy.mask.device) < policy.mask.shape[0] // 2
    for name, rows in (("chosen", chosen_rows), ("rejected", ~chosen_rows)):
        total, count = mean_logits(trainer, policy, rows)
        metrics[f"logits/{name}"].append(total / count if count > 0 else 0.0)
    chosen_mask = policy.mask.chunk(2)[0]
    correct = token_total(trainer, (policy.outputs.is_top1.chunk(2)[0] & chosen_mask).sum())
    count = token_total(trainer, chosen_mask.sum())
    metrics["mean_token_accuracy"].append((correct / count).item() if count > 0 else 0.0)
    # Full per-pair values, repeated on every SP rank: gathered over all ranks, their means are the DP means.
    chosen_rewards, rejected_rewards = (trainer.beta * r.detach() for r in ratios)
    metrics["rewards/chosen"].append(acc.gather(chosen_rewards).mean().item())
    metrics["rewards/rejected"].append(acc.gather(rejected_rewards).mean().item())
    metrics["rewards/accuracies"].append(acc.gather((chosen_rewards > rejected_rewards).float()).mean().item())
    metrics["rewards/margins"].append(acc.gather(chosen_rewards - rejected_rewards).mean().item())
    metrics["logps/chosen"].append(acc.gather(logps[0].detach()).mean().item())
    metrics["logps/rejected"].append(acc.gather(logps[1].detach()).mean().item())


def _wpo_weights(state: SequenceParallelState, policy: RowSums, scored: torch.Tensor) -> torch.Tensor:
    """WPO's per-pair weight (`use_weighting`): exp of each row's mean aligned log-prob, chosen x rejected."""
    out = policy.outputs
    with torch.no_grad():
        aligned = ((out.log_probs - out.log_sum_sq_probs) * policy.mask).sum(dim=1)
        mean = all_reduce_sum(aligned, state.groups.sp_group) / scored.clamp(min=1)
    chosen, rejected = torch.exp(mean).chunk(2)
    return chosen * rejected


def _make_compute_loss(trainer: Any, state: SequenceParallelState):
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _compute_loss(model, inputs, return_outputs):
            kwargs = _model_inputs(inputs)
            policy = row_sums(state, model, kwargs, inputs[TARGETS_KEY], aux=trainer.aux_loss_enabled)
            if trainer.precompute_ref_logps:
                ref = (inputs["ref_chosen_logps"], inputs["ref_rejected_logps"])
            else:
                with reference_forward(trainer) as reference:
                    ref = row_sums(state, reference, kwargs, inputs[TARGETS_KEY]).logps.chunk(2)
            # [2B] scored completion tokens (every completion token but a first one) and completion tokens (TRL's
            # `completion_mask.sum(1)`), whole sequence
            local = torch.stack([policy.mask.sum(dim=1), inputs["completion_mask"].sum(dim=1)])
            scored, completion = all_reduce_sum(local, state.groups.sp_group)
            pairs = Pairs(*policy.logps.chunk(2), *ref, *completion.chunk(2), chosen_scored=scored.chunk(2)[0])
            losses = pair_losses(
                pairs,
                trainer.beta,
                trainer.label_smoothing,
                trainer.args.discopop_tau,
                trainer.f_divergence_type,
                trainer.f_alpha_divergence_coef,
            )
            weight = _wpo_weights(state, policy, scored) if trainer.use_weighting else 1.0
            loss = 0.0
            for loss_type, loss_weight in zip(trainer.loss_types, trainer.loss_weights, strict=True):
                loss = loss + (losses[loss_type]() * weight).mean() * loss_weight
            ratios = (pairs.chosen - pairs.ref_chosen, pairs.rejected - pairs.ref_rejected)
            _log_metrics(trainer, inputs, policy, ratios, (pairs.chosen, pairs.rejected))
            if trainer.aux_loss_enabled:
                loss = add_router_loss(trainer, state, loss, policy)
            if not return_outputs:
                return loss
            with torch.no_grad():  # evaluation's logits (TRL recomputes them too)
                return loss, model(**kwargs, use_cache=False)

        return _compute_loss

    return make


def _make_ref_log_probs(trainer: Any, state: SequenceParallelState):
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_ref_log_probs(model, inputs):
            # TRL's precompute gathers the result with `gather_for_metrics`, which under SP adds 1-d values over
            # the SP group: return this shard's partial sums, the gather makes them whole.
            with torch.no_grad(), adapter_disabled(trainer), trainer.accelerator.autocast():
                rows = shard_sums(state, model, _model_inputs(inputs), inputs[TARGETS_KEY])
            return rows.logps.chunk(2)

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

"""TRL `KTOTrainer` under hf_longctx SP: per-row log-prob sums and the KL estimate reduced over the SP group.

TRL 1.16's KTO loss (`kto_losses.py`) is a function of each row's summed completion log-probability under the
policy and the reference, and, for `loss_type="kto"`, of one KL estimate per step: the mean of policy minus
reference log-probs of mismatched prompt / completion pairs (each prompt with its batch neighbour's completion),
averaged over every process with `gather_for_metrics`. Rows are sharded along the sequence like SFT rows and
reduced over the SP group as DPO's are (`row_logps.py`), so every SP rank holds its DP rank's whole per-row
values and computes the same loss and metrics.

The mismatched pairs are a second batch of another length. A collator wrapper builds both batches' targets on
the FULL sequences and shards the KL batch itself, through the same `SequenceShardingCollator` the Trainer's
loader uses, with its own padding and signature (its forward then sees the same row length as TRL's), stored
as one nested entry the Trainer's sharding leaves alone. The KL mean is gathered over the DP ranks only (every
SP rank holds it whole; hf_longctx's `gather_for_metrics` would add it over the SP group). The reference forward
runs a separate reference model, the PEFT policy with its adapter disabled, or TRL's precompute (which gathers
per-shard partial sums). The MoE router loss TRL adds comes from the policy forward (`hf_longctx.sequence`).
Refused at construction, by name: vision inputs, `compute_metrics` (its logits would be this rank's shard) and
a `loss_type` TRL adds later (`check_kto_settings`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.data.collator import SequenceShardingCollator
from hf_longctx.integrations.trainer.metrics import gather_replicated
from hf_longctx.integrations.trainer.state import SequenceParallelState
from hf_longctx.integrations.trl.errors import UnsupportedSetup
from hf_longctx.integrations.trl.kto_losses import LOSS_TYPES, unpaired_losses
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
)

KL_KEY = "hf_longctx_kto_kl"  # this rank's shard of the mismatched-pair batch (a dict: model inputs + targets)
_KL_KEYS = ("KL_input_ids", "KL_attention_mask", "KL_completion_mask")
_NOT_MODEL_INPUTS = ("completion_mask", "label", "ref_logps", "ref_KL_logps", TARGETS_KEY, KL_KEY)


def check_kto_settings(trainer: Any) -> None:
    """Refuse, by name, the KTOTrainer options this SP path does not compute exactly.

    Raises:
        UnsupportedSetup: naming the option and what works.
    """
    if trainer.loss_type not in LOSS_TYPES:
        raise UnsupportedSetup(
            f"its loss_type={trainer.loss_type!r} has no exact SP path in hf_longctx (loss types that work under "
            f"SP: {', '.join(LOSS_TYPES)})"
        )
    refused = {
        "a vision dataset or processor": (trainer._is_vision_dataset or trainer._is_vlm, "a text-only model"),
        # TRL recomputes logits for it in evaluation; under SP they would be this rank's slice of each sequence.
        "compute_metrics": (
            trainer.compute_metrics is not None,
            "compute_metrics=None; KTO's own evaluation metrics are exact",
        ),
    }
    for option, (bad, works) in refused.items():
        if bad:
            raise UnsupportedSetup(f"{option} has no exact SP path in hf_longctx (works under SP: {works})")


def _make_collator(trainer: Any, state: SequenceParallelState):
    groups = state.groups
    # The Trainer loader's own sharding (padding to the SP multiple, global positions, the layout the backend
    # claims, read at each call), applied to the KL batch as a batch of its own.
    shard_kl = SequenceShardingCollator(dict, groups.sp_rank, groups.sp_world_size, layout=groups.layout_slot)
    needs_kl = trainer.calculate_KL

    def make(collate: Callable[[list[Any]], Any]) -> Callable[[list[Any]], dict[str, Any]]:
        def collate_for_sp(features: list[Any]) -> dict[str, Any]:
            batch = dict(collate(features))
            wanted = ("completion_mask", "label", *(_KL_KEYS if needs_kl else ()))
            missing = [key for key in wanted if key not in batch]
            if missing:
                raise ValueError(
                    f"KTOTrainer under SP scores the completion tokens the collator marks: its batches need "
                    f"{', '.join(missing)} (TRL's DataCollatorForUnpairedPreference provides them); got keys "
                    + ", ".join(batch)
                )
            batch[TARGETS_KEY] = completion_targets(batch["input_ids"], batch["completion_mask"])
            if all(key in batch for key in _KL_KEYS):
                ids, mask, completion = (batch.pop(key) for key in _KL_KEYS)
                kl = {"input_ids": ids, "attention_mask": mask, TARGETS_KEY: completion_targets(ids, completion)}
                batch[KL_KEY] = shard_kl(kl)
            return batch

        return collate_for_sp

    return make


def _model_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k not in _NOT_MODEL_INPUTS}


def _kl_sums(sums: Callable[..., RowSums], state: SequenceParallelState, model: Any, inputs: dict) -> torch.Tensor:
    """`sums` (`row_sums` or `shard_sums`) of the mismatched-pair batch under `model`, without gradients."""
    kl = inputs[KL_KEY]
    with torch.no_grad():
        return sums(state, model, {k: v for k, v in kl.items() if k != TARGETS_KEY}, kl[TARGETS_KEY]).logps


def _log_metrics(trainer: Any, state: SequenceParallelState, inputs: dict, policy: RowSums, values: dict) -> None:
    """TRL's KTO metrics: per-token ones from this shard's partial sums, per-row ones from whole values.

    `values`: `kl` and, per side ("chosen", "rejected"), the `labels` row mask, `rewards` and `logps`.
    """
    mode = "train" if trainer.model.training else "eval"
    metrics = trainer._metrics[mode]

    def dp_total(x: torch.Tensor) -> torch.Tensor:
        # Whole on every SP rank: TRL's `gather_for_metrics(x).nansum()` over the DP ranks' values only.
        return gather_replicated(trainer.accelerator, state.groups, x).nansum()

    metrics["kl"].append(values["kl"].item())
    log_token_metrics(trainer, inputs, policy)
    counts = {}
    for side in ("chosen", "rejected"):
        total, count = mean_logits(trainer, policy, values[side]["labels"])
        if count > 0:
            metrics[f"logits/{side}"].append(total / count)
        counts[side] = dp_total(values[side]["labels"].sum()).item()
    for side in ("chosen", "rejected"):
        if counts[side] > 0:
            for name in ("rewards", "logps"):
                total = dp_total(values[side][name].detach().nansum()).item()
                metrics[f"{name}/{side}"].append(total / counts[side])
    if counts["chosen"] > 0 and counts["rejected"] > 0:
        metrics["rewards/margins"].append(metrics["rewards/chosen"][-1] - metrics["rewards/rejected"][-1])


def _make_compute_loss(trainer: Any, state: SequenceParallelState):
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _compute_loss(model, inputs, return_outputs):
            kwargs, targets = _model_inputs(inputs), inputs[TARGETS_KEY]
            # TRL's order: the policy's KL forward, the policy's, then the reference's KL and main forwards.
            kl_logps = _kl_sums(row_sums, state, model, inputs) if trainer.calculate_KL else None
            policy = row_sums(state, model, kwargs, targets, aux=trainer.aux_loss_enabled)
            if trainer.precompute_ref_logps:
                ref_logps, ref_kl_logps = inputs["ref_logps"], inputs.get("ref_KL_logps")
            else:
                with reference_forward(trainer) as reference:
                    ref_kl_logps = _kl_sums(row_sums, state, reference, inputs) if trainer.calculate_KL else None
                    ref_logps = row_sums(state, reference, kwargs, targets).logps
            if trainer.calculate_KL:
                # TRL: the batch mean, averaged over every process; here over the DP ranks (whole on each SP rank).
                kl = (kl_logps - ref_kl_logps).mean().detach()
                kl = gather_replicated(trainer.accelerator, state.groups, kl).mean().clamp(min=0)
            else:
                kl = torch.zeros(1, device=policy.logps.device)
            labels = inputs["label"].to(device=policy.logps.device, dtype=torch.bool)
            values: dict[str, Any] = {"kl": kl}
            for side, rows in (("chosen", labels), ("rejected", ~labels)):
                index = torch.nonzero(rows, as_tuple=False).view(-1)
                logps = policy.logps.index_select(0, index)
                ratios = logps - ref_logps.to(logps.device).index_select(0, index)
                values[side] = {"labels": rows, "logps": logps, "ratios": ratios, "rewards": trainer.beta * ratios}
            weights = (trainer.desirable_weight, trainer.undesirable_weight)
            losses = unpaired_losses(
                values["chosen"]["ratios"], values["rejected"]["ratios"], kl, trainer.beta, trainer.loss_type, weights
            )
            _log_metrics(trainer, state, inputs, policy, values)
            loss = losses.nanmean()
            if trainer.aux_loss_enabled:
                loss = add_router_loss(trainer, state, loss, policy)
            if not return_outputs:
                return loss
            with torch.no_grad():  # evaluation's logits (TRL recomputes them too); no compute_metrics reads them
                return loss, model(**kwargs, use_cache=False)

        return _compute_loss

    return make


def _make_ref_log_probs(trainer: Any, state: SequenceParallelState):
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def compute_ref_log_probs(model, inputs):
            # TRL's precompute gathers the result with `gather_for_metrics`, which under SP adds 1-d values over
            # the SP group: return this shard's partial sums, the gather makes them whole.
            from trl.models.utils import disable_gradient_checkpointing

            checkpointing = disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs)
            with torch.no_grad(), checkpointing, adapter_disabled(trainer), trainer.accelerator.autocast():
                logps = shard_sums(state, model, _model_inputs(inputs), inputs[TARGETS_KEY]).logps
                kl_logps = _kl_sums(shard_sums, state, model, inputs) if trainer.calculate_KL else None
            return logps, kl_logps

        return compute_ref_log_probs

    return make


def setup_kto(trainer: Any, state: SequenceParallelState) -> Callable[[], None]:
    """Patch one `KTOTrainer` instance for SP (idempotent); returns the undo.

    Runs inside `Trainer.__init__` (`_validate_args`): the data collator is set, the reference model and
    TRL's fused LM head are not yet, and are looked up at every step.

    Raises:
        UnsupportedSetup: an option without an exact SP path (see `check_kto_settings`).
    """
    check_kto_settings(trainer)
    patches = [
        Patch(trainer, "data_collator", _make_collator(trainer, state)),
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

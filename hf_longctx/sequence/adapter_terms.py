"""PEFT adapters whose forward adds a term of the parameters alone to the loss: AdaLoRA's orthogonal regulariser.

PEFT 0.22's `AdaLoraModel.forward` adds `orth_reg_weight * mean_i ||P_i P_i^T - I||_F` (over the trainable adapter's
`lora_A` / `lora_B` matrices) to the model's loss when the model returns one. Two cases under SP:

- **The model computes its loss from the shard** (causal LM, sequence classification): every rank's loss is a share
  of the token loss (the shares of an SP group sum to it), but each rank would add the whole regulariser, so the
  group would count it P times (measured at SP=2: loss 6.53 against 5.70, the adapter gradients 100% off). For the
  duration of each forward the weight is divided by the SP size, so the group's shares add up to it once; the
  config is restored when the forward ends (also after an exception), so a checkpoint keeps the user's weight.
- **A head whose loss hf_longctx computes after the forward** (token classification, QA: `head_losses.py`): the
  labels are taken out of the call, so PEFT sees no loss and adds nothing (measured at SP=2 with token
  classification: loss 1.63 against 2.47, the regulariser silently gone). Each rank's head loss is whole-sized (the
  group averages it, as data parallelism does), so the whole regulariser is added to it here, computed as PEFT
  does. Written here because PEFT computes it only inline in `AdaLoraModel.forward`, which never sees the loss.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.distributed.groups import SequenceParallelGroups

_WEIGHT = "orth_reg_weight"


def _adalora_tuner(model: Any) -> Any:
    """The `AdaLoraModel` of a PEFT model (its `base_model`), or None."""
    tuner = getattr(model, "base_model", None)
    configs = getattr(tuner, "peft_config", None) or {}
    name = getattr(tuner, "trainable_adapter_name", None)
    config = configs.get(name) if isinstance(configs, dict) else None
    return tuner if str(getattr(config, "peft_type", "")).endswith("ADALORA") else None


def orthogonal_regulariser(tuner: Any) -> torch.Tensor | float:
    """The mean over the trainable adapter's `lora_A` / `lora_B` of `||P P^T - I||_F` (A) or `||P^T P - I||_F`
    (B), each parameter gathered first where ZeRO-3 has partitioned it (0.0 without such parameters)."""
    from peft.utils.integrations import gather_params_ctx

    name, norms = tuner.trainable_adapter_name, []
    for key, param in tuner.model.named_parameters():
        if name not in key or not ("lora_A" in key or "lora_B" in key):
            continue
        with gather_params_ctx(param, fwd_module=tuner):
            cov = param @ param.T if "lora_A" in key else param.T @ param
        eye = torch.eye(*cov.shape, dtype=cov.dtype, device=cov.device)
        norms.append(torch.linalg.matrix_norm(cov - eye, ord="fro"))
    return torch.stack(norms).mean() if norms else 0.0


class AdapterTerms:
    """The AdaLoRA regulariser of one SP model: shared over the SP group per forward (`shared`), or added whole to
    the loss a head computes after the forward (`add_to`)."""

    def __init__(self, tuner: Any, groups: SequenceParallelGroups, shared: bool) -> None:
        self.tuner, self.groups, self.shared = tuner, groups, shared
        self.configs = [c for c in tuner.peft_config.values() if str(getattr(c, "peft_type", "")).endswith("ADALORA")]
        self.saved: list[float] | None = None

    @classmethod
    def attach(cls, model: Any, groups: SequenceParallelGroups, shared: bool) -> AdapterTerms | None:
        """The terms of `model`'s adapters (None: no adapter adds one, or one rank holds the whole row). `shared`:
        the model's own loss is this rank's share (False: a head's loss computed by hf_longctx)."""
        tuner = _adalora_tuner(model)
        return cls(tuner, groups, shared) if tuner is not None and groups.sp_enabled else None

    def begin(self) -> None:
        self.finish()  # a forward that never finished
        if self.shared:
            self.saved = [getattr(config, _WEIGHT) for config in self.configs]
            for config, weight in zip(self.configs, self.saved, strict=True):
                setattr(config, _WEIGHT, weight / self.groups.sp_world_size)

    def add_to(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` (a head's, whole-sized on every rank) plus the regulariser at the user's weight."""
        weight = getattr(self.tuner.peft_config[self.tuner.trainable_adapter_name], _WEIGHT)
        if weight < 0:
            raise ValueError("orth_reg_weight should be greater than or equal to 0 (AdaLoraConfig).")
        return loss + weight * orthogonal_regulariser(self.tuner)

    def finish(self) -> None:
        if self.saved is not None:
            for config, weight in zip(self.configs, self.saved, strict=True):
                setattr(config, _WEIGHT, weight)
        self.saved = None

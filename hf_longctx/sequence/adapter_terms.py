"""PEFT adapters whose forward adds a term of the parameters alone to the loss: AdaLoRA's orthogonal regulariser.

PEFT 0.22's `AdaLoraModel.forward` adds `orth_reg_weight * mean_i ||P_i P_i^T - I||_F` to the model's loss. Under SP
every rank's loss is a share of the token loss (the shares of an SP group sum to it) but each rank would add the
whole regulariser, so the group would count it P times (measured at SP=2: loss 6.53 against 5.70, the adapter
gradients 100% off). For the duration of each forward the weight is divided by the SP size, so the group's shares
of the regulariser add up to it once; the config is restored when the forward ends (also after an exception), so
a checkpoint saved between steps keeps the user's weight.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.distributed.groups import SequenceParallelGroups

_WEIGHT = "orth_reg_weight"


class AdapterTerms:
    """The AdaLoRA configs of one SP model, whose regulariser weight is shared over the SP group per forward."""

    def __init__(self, configs: list[Any], groups: SequenceParallelGroups) -> None:
        self.configs, self.groups = configs, groups
        self.saved: list[float] | None = None

    @classmethod
    def attach(cls, model: Any, groups: SequenceParallelGroups) -> AdapterTerms | None:
        """The terms of `model`'s adapters (None: no adapter adds one, or one rank holds the whole row)."""
        configs = [
            config
            for config in (getattr(model, "peft_config", None) or {}).values()
            if hasattr(config, _WEIGHT) and str(getattr(config, "peft_type", "")).endswith("ADALORA")
        ]
        return cls(configs, groups) if configs and groups.sp_enabled else None

    def begin(self) -> None:
        self.finish()  # a forward that never finished
        self.saved = [getattr(config, _WEIGHT) for config in self.configs]
        for config, weight in zip(self.configs, self.saved, strict=True):
            setattr(config, _WEIGHT, weight / self.groups.sp_world_size)

    def finish(self) -> None:
        if self.saved is not None:
            for config, weight in zip(self.configs, self.saved, strict=True):
                setattr(config, _WEIGHT, weight)
        self.saved = None

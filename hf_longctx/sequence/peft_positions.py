"""The shard's `position_ids` through a PEFT task wrapper that drops them.

PEFT 0.22's `PeftModelForQuestionAnswering.forward` names `position_ids` (and `token_type_ids`) as parameters and
never passes them on to its tuner, so the transformers model computes its RoPE from `arange` of the shard: under SP
every rank but the first rotates its tokens by the wrong positions (measured at SP=2 with AdaLoRA on a Llama QA
head: loss 5e-5 off, no error), and packed rows lose their per-document positions at any SP size. The other PEFT
task wrappers pass unnamed keywords through. A pre-hook on the outer PEFT model records the call's `position_ids`;
one on its tuner (which runs the transformers model with the keywords it gets) puts them back where they are
missing. Both are installed with the SP handle and removed with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def keep_position_ids(model: torch.nn.Module) -> list[Callable[[], None]]:
    """Hooks that carry the call's `position_ids` past a PEFT wrapper to its tuner; their removers ([] for a model
    without a PEFT tuner, e.g. a transformers model or prompt learning, which calls the model itself)."""
    try:
        from peft.tuners.tuners_utils import BaseTuner
    except ImportError:
        return []
    tuner = getattr(model, "base_model", None)
    if tuner is model or not isinstance(tuner, BaseTuner):
        return []
    call: dict[str, Any] = {}

    def record(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        call["position_ids"] = kwargs.get("position_ids")

    def restore(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        positions = call.pop("position_ids", None)
        if positions is None or kwargs.get("position_ids") is not None:
            return None
        return args, {**kwargs, "position_ids": positions}

    hooks = [
        model.register_forward_pre_hook(record, with_kwargs=True),
        tuner.register_forward_pre_hook(restore, with_kwargs=True),
    ]
    return [hook.remove for hook in hooks]

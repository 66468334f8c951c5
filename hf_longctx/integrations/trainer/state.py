"""What `attach` installed on one accelerator (`SequenceParallelState`) and how to find it again.

Kept apart from `accelerator.py` so the data loader, evaluation and Trainer patches can read the state
without importing the module that installs them (no import cycle inside the integration).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_longctx.attention.registry import SequenceParallelHandle, check_model, enable_sequence_parallel
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.memory.flags import MemoryHandle, apply_memory_flags

STATE_ATTR = "_hf_longctx_state"


@dataclass(eq=False)
class SequenceParallelState:
    """What `attach` installed on one accelerator, and how to undo it."""

    config: Any
    groups: SequenceParallelGroups
    handles: list[SequenceParallelHandle | MemoryHandle] = field(default_factory=list)
    wrapped: list[str] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)  # collate_fn and Trainer attributes
    checked: set[int] = field(default_factory=set)  # ids of models already validated
    # Set by a TRL trainer's SP path (RewardTrainer, GRPOTrainer) whose loss and outputs are computed from whole
    # sequences on every SP rank: evaluation takes them as they are (`evaluation.replicated_prediction`).
    replicated_outputs: bool = False
    verified: bool = False  # the first training step's checks passed (`first_step.verify_first_step`)

    def enable(self, model: Any) -> None:
        """Switch `model` (unwrapped transformers model) to SP attention once."""
        model = _unwrap(model)
        if getattr(model, "config", None) is None or any(h.model is model for h in self.handles):
            return
        self.handles.append(enable_sequence_parallel(model, self.groups, **self.config.attention_options()))
        # Memory flags (tiled loss / MLP, activation offload; hf_longctx/memory): a no-op handle when all off.
        # A PEFT model's flags go on the transformers model it wraps (PEFT calls its forward directly).
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.handles.append(apply_memory_flags(base, self.config))

    def check(self, model: Any) -> None:
        """Validate a model SP will run (heads, kernel, token mixers) once, without changing it."""
        model = _unwrap(model)
        enabled = any(h.model is model for h in self.handles)  # checked when enabled (its kernel is ours now)
        if id(model) in self.checked or enabled or getattr(model, "config", None) is None:
            return
        options = {**self.config.attention_options(), "ranks_per_node": self.groups.ranks_per_node}
        check_model(model, self.groups.sp_world_size, **options)
        self.checked.add(id(model))

    def close(self) -> None:
        """Restore every model and data loader, then destroy the process groups (idempotent)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        while self.undo:
            self.undo.pop()()
        self.groups.destroy()


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def sp_state(trainer_or_accelerator: Any) -> SequenceParallelState | None:
    """The attached state of a Trainer's (or an Accelerator's) hf_longctx SP, or None."""
    accelerator = getattr(trainer_or_accelerator, "accelerator", trainer_or_accelerator)
    return getattr(accelerator, STATE_ATTR, None)


@contextlib.contextmanager
def sp_hidden(config: Any) -> Iterator[None]:
    """Show accelerate a config without SP: to it every rank is a data-parallel rank.

    accelerate refuses `sp_size > 1` for any backend but its own while preparing DeepSpeed, and
    its batch-size and mesh arithmetic would count SP ranks; gradients must be averaged over all
    ranks anyway (`sequence_parallel_loss` semantics), which is what a pure-DP view gives.
    """
    sp_size = config.sp_size
    config.sp_size = 1
    if hasattr(config, "_sizes"):
        config._sizes["sp"] = 1
    try:
        yield
    finally:
        config.sp_size = sp_size
        if hasattr(config, "_sizes"):
            config._sizes["sp"] = sp_size

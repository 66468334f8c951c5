"""NEFTune under SP: the Trainer's noise hook swapped for one scaled by the whole row's length.

`Trainer.train()` attaches transformers' `neftune_post_forward_hook` to the input embeddings before the training
loop starts; under SP that hook reads the shard's length (`hf_longctx/sequence/neftune.py`). `use_sp_neftune` runs
from `prepare_trainer`, after the hook exists: it removes it and registers hf_longctx's hook in its place, stored
as the Trainer's `neftune_hook_handle`, so the Trainer's own `deactivate_neftune` at the end of `train()` removes it.
"""

from __future__ import annotations

from typing import Any

from hf_longctx.integrations.trainer.state import SequenceParallelState, _unwrap

_SWAPPED_ATTR = "_hf_longctx_neftune_hook_id"


def _embeddings(model: Any) -> Any:
    # Where transformers' `activate_neftune` puts its hook (a PEFT model's: its base model's).
    base = model.base_model.model if hasattr(model, "get_base_model") else model
    return base.get_input_embeddings()


def use_sp_neftune(trainer: Any, state: SequenceParallelState) -> None:
    """Swap the Trainer's NEFTune hook for hf_longctx's (idempotent; nothing to do without NEFTune)."""
    hook = getattr(trainer, "neftune_hook_handle", None)
    if getattr(trainer, "neftune_noise_alpha", None) is None or hook is None:
        return
    if getattr(trainer, _SWAPPED_ATTR, None) == hook.id:
        return
    model = _unwrap(trainer.accelerator.unwrap_model(trainer.model))
    state.enable(model)  # as `prepare` will (idempotent): the hook reads the SP handle's view of each forward
    handle = next(h for h in state.handles if getattr(h, "model", None) is model)
    hook.remove()
    trainer.neftune_hook_handle = _embeddings(model).register_forward_hook(handle.sequence.neftune_hook())
    setattr(trainer, _SWAPPED_ATTR, trainer.neftune_hook_handle.id)

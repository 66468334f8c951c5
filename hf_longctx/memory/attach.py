"""Memory flags without sequence parallelism: apply them to every model an accelerator prepares.

With `sp_size > 1` the SP integration (`hf_longctx.integrations.trainer`) applies them next to SP attention;
with `sp_size == 1` it calls `attach_memory_flags(config, accelerator)` instead, which wraps only
that accelerator's `prepare` / `prepare_model` (instance attributes, undone by `detach_memory_flags`).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.memory.flags import MemoryHandle, apply_memory_flags, memory_flags_enabled

STATE_ATTR = "_hf_longctx_memory"


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def attach_memory_flags(config: Any, accelerator: Any) -> None:
    """Make `accelerator.prepare(model)` apply `config`'s memory flags to each model once."""
    if not memory_flags_enabled(config) or hasattr(accelerator, STATE_ATTR):
        return
    handles: list[MemoryHandle] = []
    prepare, prepare_model = accelerator.prepare, accelerator.prepare_model

    def enable(model: Any) -> None:
        model = _unwrap(model)
        if getattr(model, "config", None) is not None and not any(h.model is model for h in handles):
            handles.append(apply_memory_flags(model, config))

    def prepare_with_flags(*args: Any, **kwargs: Any) -> Any:
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                enable(obj)
        return prepare(*args, **kwargs)

    def prepare_model_with_flags(model: Any, *args: Any, **kwargs: Any) -> Any:
        enable(model)
        return prepare_model(model, *args, **kwargs)

    accelerator.prepare = prepare_with_flags
    accelerator.prepare_model = prepare_model_with_flags
    setattr(accelerator, STATE_ATTR, handles)


def detach_memory_flags(accelerator: Any) -> None:
    """Undo `attach_memory_flags`: restore the models and the accelerator's methods."""
    handles = accelerator.__dict__.pop(STATE_ATTR, None)
    if handles is None:
        return
    for handle in handles:
        handle.remove()
    for name in ("prepare", "prepare_model"):
        accelerator.__dict__.pop(name, None)

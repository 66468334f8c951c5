"""The memory flags applied together: `apply_memory_flags` and its undo handle (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.memory.offload import enable_offload_activations
from hf_longctx.memory.tiled_layer import enable_tiled_layer
from hf_longctx.memory.tiled_loss import enable_tiled_loss
from hf_longctx.memory.tiled_mlp import enable_tiled_mlp

FLAG_NAMES = ("tiled_loss", "tiled_mlp", "tiled_layer", "offload_activations")


class MemoryHandle:
    """Undo record of `apply_memory_flags`: `.remove()` undoes every flag, last applied first."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.parts: dict[str, Any] = {}
        self._undo: list[Callable[[], None]] = []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.parts.clear()

    def __enter__(self) -> MemoryHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def memory_flags_enabled(config: Any) -> bool:
    """True when `config` (e.g. `hf_longctx.ParallelismConfig`) turns any memory flag on."""
    return any(
        getattr(config, name, False) for name in ("tiled_loss", "tiled_mlp", "tiled_layer", "offload_activations")
    )


def apply_memory_flags(model: torch.nn.Module, config: Any) -> MemoryHandle:
    """Apply `config.tiled_loss`, `config.tiled_mlp`, `config.tiled_layer` and `config.offload_activations` to `model`.

    `tiled_layer` goes before `tiled_mlp`, which then leaves the MLPs of tiled layers alone (the layer
    tiles them). With `offload_activations` too, what a tiled layer saves of its input goes through the offload's
    saved-tensor hooks (one host copy per layer; see `memory/tiled_layer.py`).

    Args:
        model: the unwrapped transformers model (before or after DDP / FSDP2 / DeepSpeed wrapping).
        config: any object with those attributes (missing ones count as off).

    Returns:
        A handle; `.remove()` restores the model. Applying all-off flags returns an empty handle.

    Raises:
        ValueError: a flag cannot apply to this model (the message names the flag to turn off);
            nothing stays applied.
    """
    handle = MemoryHandle(model)
    steps = [
        ("offload_activations", lambda: enable_offload_activations(model)),
        ("tiled_layer", lambda: enable_tiled_layer(model, config.tiled_layer)),
        ("tiled_mlp", lambda: enable_tiled_mlp(model, config.tiled_mlp, _tiled_layer_mlps(handle))),
        ("tiled_loss", lambda: enable_tiled_loss(model, config.tiled_loss)),
    ]
    try:
        for name, enable in steps:
            if getattr(config, name, False):
                part = enable()
                handle.parts[name] = part
                handle._undo.append(part.remove)
    except Exception:
        handle.remove()
        raise
    return handle


def _tiled_layer_mlps(handle: MemoryHandle) -> list[torch.nn.Module]:
    part = handle.parts.get("tiled_layer")
    return part.mlps if part is not None else []

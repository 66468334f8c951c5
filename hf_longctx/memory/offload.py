"""`offload_activations`: checkpoint every decoder layer and keep its saved input in host memory.

`enable_offload_activations(model)` is the main entry. Each transformers decoder layer
(`GradientCheckpointingLayer`) is checkpointed, through the checkpoint function it already has
when `gradient_checkpointing` is on (so `use_reentrant` and the other user settings stay) or
non-reentrant `torch.utils.checkpoint` otherwise. Under saved-tensor hooks of our own, the tensor
that checkpoint saves for the layer's positional inputs (the hidden states entering the layer,
`[bs, sl_l, hidden]` per layer: what checkpointing keeps) is copied to pinned host memory on a
side stream during the forward, and copied back on that stream one layer ahead of the backward
recompute (when layer i is unpacked, layer i-1's input starts its trip back). Everything else a
layer saves (shared position embeddings, masks) stays where it is.

Why not `torch.autograd.graph.save_on_cpu` (what transformers' `activation_checkpointing_enable(
offload=True)` uses) or TRL's `OffloadActivations`: the first copies back on the compute stream
when autograd asks, with no prefetch; the second offloads every saved tensor of the step, not only
the checkpoint inputs, and installs permanent hooks on the model. On CPU there is nothing to move
(activations already live in host memory): the flag then is plain checkpointing.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)


@dataclass
class _Saved:
    """One offloaded tensor: its host copy and, once fetched, its device copy and ready event."""

    host: torch.Tensor
    device: torch.device
    fetched: torch.Tensor | None = None
    ready: Any = None  # a CUDA event recorded on the copy stream after the fetch


@dataclass(eq=False)
class _LayerInputs:
    """The offloaded inputs of one checkpointed layer call, linked to the previous layer's."""

    saved: list[_Saved] = field(default_factory=list)
    previous: Any = None  # weakref to the _LayerInputs of the layer that ran before this one


class HostOffload:
    """Saved-tensor hooks that keep checkpointed layer inputs in host memory.

    Args:
        always_copy: also copy tensors already in host memory (a CPU-only machine then runs the
            same pack / fetch / unpack path an accelerator does; used by the tests).
    """

    def __init__(self, always_copy: bool = False) -> None:
        self.always_copy = always_copy
        self._last: weakref.ref | None = None
        self._stream: Any = None

    def new_step(self) -> None:
        """Forget the previous forward's layers (called at the start of every model forward)."""
        self._last = None

    def _copy_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, group: _LayerInputs, inputs: list[torch.Tensor], t: torch.Tensor) -> Any:
        offload = any(t.data_ptr() == x.data_ptr() and t.shape == x.shape for x in inputs)
        if not offload or (t.device.type == "cpu" and not self.always_copy):
            return t
        stream = self._copy_stream(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=stream is not None)
        if stream is None:
            host.copy_(t)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy is done
        saved = _Saved(host, t.device)
        group.saved.append(saved)
        return saved

    def _fetch(self, group: _LayerInputs) -> None:
        for saved in group.saved:
            if saved.fetched is not None:
                continue
            stream = self._copy_stream(saved.device)
            if stream is None:
                saved.fetched = saved.host.to(saved.device, copy=True)
                continue
            with torch.cuda.stream(stream):
                saved.fetched = saved.host.to(saved.device, non_blocking=True)
                saved.ready = stream.record_event()

    def _unpack(self, group: _LayerInputs, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        self._fetch(group)
        previous = group.previous() if group.previous is not None else None
        if previous is not None:
            self._fetch(previous)  # prefetch: the layer recomputed next in backward
        tensor, packed.fetched = packed.fetched, None
        if packed.ready is not None:
            current = torch.cuda.current_stream(packed.device)
            current.wait_event(packed.ready)
            tensor.record_stream(current)
        return tensor

    @contextmanager
    def offloading(self, args: tuple) -> Iterator[None]:
        """Offload, inside the block, what autograd saves of the tensors in `args` (one layer call)."""
        group = _LayerInputs(previous=self._last)
        self._last = weakref.ref(group)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        pack = functools.partial(self._pack, group, inputs)
        unpack = functools.partial(self._unpack, group)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield


def offloaded_checkpoint(
    offload: HostOffload, inner: Callable[..., Any], function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """`inner(function, *args, **kwargs)` (a checkpoint function) with the saved inputs offloaded."""
    with offload.offloading(args):
        return inner(function, *args, **kwargs)


class OffloadHandle:
    """Undo record of `enable_offload_activations`; `.remove()` restores every layer's settings."""

    def __init__(self, model: torch.nn.Module, offload: HostOffload, layers: int) -> None:
        self.model, self.offload, self.layers = model, offload, layers
        self._undo: list[Callable[[], None]] = []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


_MISSING = object()


def enable_offload_activations(model: torch.nn.Module, always_copy: bool = False) -> OffloadHandle:
    """Checkpoint every decoder layer of `model` with its saved input held in host memory.

    Call it after `gradient_checkpointing_enable` / `activation_checkpointing_enable` if those
    are used (the Trainer enables them before preparing the model): the layer's checkpoint
    function at this moment is the one wrapped.

    Args:
        model: a transformers model with `GradientCheckpointingLayer` decoder layers.
        always_copy: see `HostOffload`.

    Returns:
        A handle; `.remove()` restores each layer's `gradient_checkpointing` and checkpoint function.

    Raises:
        ValueError: the model has no `GradientCheckpointingLayer`.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"offload_activations needs transformers decoder layers (GradientCheckpointingLayer); "
            f"{type(model).__name__} has none; set offload_activations=False."
        )
    offload = HostOffload(always_copy)
    handle = OffloadHandle(model, offload, len(layers))
    default = functools.partial(checkpoint, use_reentrant=False)
    for layer in layers:
        saved = {k: layer.__dict__.get(k, _MISSING) for k in ("gradient_checkpointing", "_gradient_checkpointing_func")}
        inner = layer._gradient_checkpointing_func if layer.gradient_checkpointing else default
        layer._gradient_checkpointing_func = functools.partial(offloaded_checkpoint, offload, inner)
        layer.gradient_checkpointing = True
        handle._undo.append(functools.partial(_restore, layer, saved))
    hook = model.register_forward_pre_hook(lambda *_: offload.new_step())
    handle._undo.append(hook.remove)
    logger.info("hf_longctx: offload_activations on %d layers of %s", len(layers), type(model).__name__)
    return handle


def _restore(layer: torch.nn.Module, saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        if value is _MISSING:
            layer.__dict__.pop(key, None)
        else:
            setattr(layer, key, value)

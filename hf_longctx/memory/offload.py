"""`offload_activations`: checkpoint every decoder layer and keep its saved input in host memory.

`enable_offload_activations(model)` is the main entry. Each transformers decoder layer
(`GradientCheckpointingLayer`) is checkpointed, through the checkpoint function it already has
when `gradient_checkpointing` is on (so `use_reentrant` and the other user settings stay) or
non-reentrant `torch.utils.checkpoint` otherwise. Under saved-tensor hooks of our own, the tensor
that checkpoint saves for the layer's positional inputs (the hidden states entering the layer,
`[bs, sl_l, hidden]` per layer: what checkpointing keeps) is copied to pinned host memory on a
side stream during the forward, and copied back on that stream one layer ahead of the backward
recompute (when layer i is unpacked, layer i-1's input starts its trip back). Everything else a
layer saves (shared position embeddings, masks) stays where it is. A sequence-tiled layer
(`tiled_layer.py`) uses the same hooks directly, without the checkpoint: what its tiles save are views
of its input, which share that input's one host copy.

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


@dataclass(eq=False)
class _Saved:
    """One offloaded tensor: its host copy and, once fetched, its device copy and ready event. `pending` counts
    the packed references (the tensor and views of it) not unpacked yet; the device copy goes with the last."""

    host: torch.Tensor
    device: torch.device
    fetched: torch.Tensor | None = None
    ready: Any = None  # a CUDA event recorded on the copy stream after the fetch
    pending: int = 0


@dataclass(frozen=True)
class _View:
    """A saved view of an offloaded (contiguous) input: its geometry in the input's elements."""

    saved: _Saved
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(eq=False)
class _LayerInputs:
    """The offloaded inputs of one layer call (checkpointed or tiled), linked to the previous layer's."""

    saved: dict[int, _Saved] = field(default_factory=dict)  # input index -> its host copy
    previous: Any = None  # weakref to the _LayerInputs of the layer that ran before this one


def _view_offset(t: torch.Tensor, x: torch.Tensor) -> int | None:
    """The element offset of `t` in contiguous `x` when `t` is `x` or a view inside it, else None."""
    if t.device != x.device or t.dtype != x.dtype or t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():
        return None
    offset = t.storage_offset() - x.storage_offset()
    last = offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return offset if t.numel() and 0 <= offset and last < x.numel() else None


class HostOffload:
    """Saved-tensor hooks that keep checkpointed layer inputs in host memory.

    What autograd saves of an input, or of a view of a contiguous input (a sequence-tiled layer saves its
    tiles), shares one host copy of that input; unpacking returns the view of its device copy.

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

    def _offload(self, x: torch.Tensor) -> _Saved:
        stream = self._copy_stream(x.device)
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=stream is not None)
        if stream is None:
            host.copy_(x)
        else:
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                host.copy_(x, non_blocking=True)
            x.record_stream(stream)  # the allocator keeps x's memory until the copy is done
        return _Saved(host, x.device)

    def _pack(self, group: _LayerInputs, inputs: list[weakref.ref], t: torch.Tensor) -> Any:
        if t.device.type == "cpu" and not self.always_copy:
            return t
        for i, ref in enumerate(inputs):
            x = ref()
            if x is None:
                continue
            exact = t.data_ptr() == x.data_ptr() and t.shape == x.shape and t.stride() == x.stride()
            offset = _view_offset(t, x) if x.is_contiguous() else (0 if exact else None)
            if offset is None:
                continue
            saved = group.saved.get(i)
            if saved is None:
                saved = group.saved[i] = self._offload(x)
            saved.pending += 1
            return saved if exact else _View(saved, tuple(t.shape), t.stride(), offset)
        return t

    def _fetch(self, group: _LayerInputs, wanted: _Saved | None = None) -> None:
        """Start copying back the group's inputs still to be unpacked (and `wanted`, unpacked again by a second
        backward over a retained graph)."""
        for saved in group.saved.values():
            if saved.fetched is not None or (saved.pending == 0 and saved is not wanted):
                continue
            stream = self._copy_stream(saved.device)
            if stream is None:
                saved.fetched = saved.host.to(saved.device, copy=True)
                continue
            with torch.cuda.stream(stream):
                saved.fetched = saved.host.to(saved.device, non_blocking=True)
                saved.ready = stream.record_event()

    def _unpack(self, group: _LayerInputs, packed: Any) -> torch.Tensor:
        saved = packed.saved if isinstance(packed, _View) else packed
        if not isinstance(saved, _Saved):
            return packed
        self._fetch(group, saved)
        previous = group.previous() if group.previous is not None else None
        if previous is not None:
            self._fetch(previous)  # prefetch: the layer recomputed next in backward
        tensor = saved.fetched
        if saved.ready is not None:
            current = torch.cuda.current_stream(saved.device)
            current.wait_event(saved.ready)
            tensor.record_stream(current)
        saved.pending = max(saved.pending - 1, 0)
        if saved.pending == 0:
            saved.fetched = saved.ready = None
        return tensor if saved is packed else tensor.as_strided(packed.size, packed.stride, packed.offset)

    def hooks(self, args: tuple) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """The pack / unpack pair that offloads what autograd saves of the tensors in `args` (one layer call)."""
        group = _LayerInputs(previous=self._last)
        self._last = weakref.ref(group)
        # Weak references: autograd keeps the pack hook as long as what it saved, which must not keep the
        # device input alive (that would be the memory the offload is for).
        inputs = [weakref.ref(a) for a in args if isinstance(a, torch.Tensor)]
        return functools.partial(self._pack, group, inputs), functools.partial(self._unpack, group)

    @contextmanager
    def offloading(self, args: tuple) -> Iterator[None]:
        """Offload, inside the block, what autograd saves of the tensors in `args` (one layer call)."""
        with torch.autograd.graph.saved_tensors_hooks(*self.hooks(args)):
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

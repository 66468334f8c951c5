"""`sp_size=1`: hf_longctx's attention and memory flags on every model one accelerator prepares.

Without SP, transformers builds a dense `[S, S]` mask for rows of packed documents under sdpa and eager (a packed
row of 1.2M tokens asked for 1,341 GiB on an H200, 2026-12-04). `attach_single(config, accelerator)` wraps that
accelerator's `prepare` / `prepare_model` (instance attributes): each model gets the config's memory flags and,
when it is a text decoder whose token mixers are all softmax attention, hf_longctx's attention with
single-process groups (`enable_sequence_parallel(model, SequenceParallelGroups.single())`): its own kernel per
document of `position_ids`, no mask; generation (`generate()`, a filled KV cache, left padding) runs the model's
own attention (`attention/single.py`). Vision-language models are served too (the image merge and per-document
mRoPE positions of `multimodal/vision.py`, so packed VLM rows train as at SP > 1), except those
`vision_refusal` names (Gemma 3); linear-attention models, decoders that do not call transformers' attention
interface and attention that is not causal (`attention/semantics.py`) keep theirs (logged).
`detach_single` undoes everything.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from hf_longctx.attention.linear.support import linear_layers
from hf_longctx.attention.registry import SequenceParallelHandle, check_model, enable_sequence_parallel
from hf_longctx.attention.semantics import uses_attention_interface
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.memory.flags import MemoryHandle, apply_memory_flags
from hf_longctx.multimodal.vision import multimodal_model, vision_refusal

logger = logging.getLogger(__name__)
STATE_ATTR = "_hf_longctx_single"


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def document_attention_refusal(model: torch.nn.Module, config: Any) -> str | None:
    """Why `model` keeps its own attention at `sp_size=1` (None: hf_longctx serves it)."""
    inner = multimodal_model(model)
    refused = vision_refusal(inner) if inner is not None else None
    if refused:
        return f"a vision-language model: {refused}"
    if linear_layers(model):
        return "it has linear-attention layers"
    if not uses_attention_interface(model):
        return "its decoder computes attention itself, without transformers' attention interface"
    try:
        check_model(model, 1, "ulysses", ulysses_head_chunks=config.ulysses_head_chunks)
    except ValueError as err:
        return str(err)
    return None


def attach_single(config: Any, accelerator: Any) -> None:
    """Make `accelerator.prepare(model)` give each model document attention and `config`'s memory flags, once."""
    if hasattr(accelerator, STATE_ATTR):
        return
    handles: list[SequenceParallelHandle | MemoryHandle] = []
    prepare, prepare_model = accelerator.prepare, accelerator.prepare_model

    def enable(model: Any) -> None:
        model = _unwrap(model)
        if getattr(model, "config", None) is None or any(h.model is model for h in handles):
            return
        why = document_attention_refusal(model, config)
        if why is None:
            handles.append(enable_sequence_parallel(model, SequenceParallelGroups.single(), backend="ulysses",
                                                    ulysses_head_chunks=config.ulysses_head_chunks))  # fmt: skip
        else:
            logger.warning(
                "hf_longctx: %s keeps its own attention at sp_size=1 (%s): rows of packed documents get a dense "
                "[S, S] mask from transformers under sdpa or eager.",
                type(model).__name__,
                why,
            )
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        handles.append(apply_memory_flags(base, config))

    def prepare_single(*args: Any, **kwargs: Any) -> Any:
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                enable(obj)
        return prepare(*args, **kwargs)

    def prepare_model_single(model: Any, *args: Any, **kwargs: Any) -> Any:
        enable(model)
        return prepare_model(model, *args, **kwargs)

    accelerator.prepare = prepare_single
    accelerator.prepare_model = prepare_model_single
    setattr(accelerator, STATE_ATTR, handles)


def detach_single(accelerator: Any) -> None:
    """Undo `attach_single`: restore the models and the accelerator's methods."""
    handles = accelerator.__dict__.pop(STATE_ATTR, None)
    if handles is None:
        return
    for handle in reversed(handles):
        handle.remove()
    for name in ("prepare", "prepare_model"):
        accelerator.__dict__.pop(name, None)

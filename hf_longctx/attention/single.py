"""Without SP (single-process groups, what `sp_size=1` attaches): which forwards hf_longctx's attention serves.

Training forwards are served per document of `position_ids`, with no mask. Generation is left to the model's own
attention and mask: a forward with a filled KV cache or with left padding (`single_process_positions` gives None),
and the whole of `generate()` (`model_attention_in_generate`), because transformers builds a static cache's masks
in `prepare_inputs_for_generation`, outside the model's forward, where a forward-time swap would come too late.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.data.sharding import document_positions, right_padded

logger = logging.getLogger(__name__)


def single_process_positions(kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The positions whose documents the attention follows, or None when the forward is left to the model's own
    attention and mask: a KV cache that already holds tokens, or padding that is not right padding (both are
    generation; training batches are right-padded or packed).

    Documents as `shard_batch` finds them (`data.sharding.document_positions`).

    Raises:
        ValueError: `cu_seq_lens_q` without `position_ids` for a batch of several rows.
    """
    for name in ("cache", "past_key_values"):  # transformers 5.25 renames past_key_values to cache
        cache = kwargs.get(name)
        if cache is not None and hasattr(cache, "get_seq_length") and int(cache.get_seq_length()) > 0:
            return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not right_padded(mask):
        return None
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3:
        return None  # a VLM's precomputed mRoPE positions ([3 or 4, batch, seq]): the model's own forward, as given
    ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if ids is None:
        return kwargs.get("position_ids")
    return document_positions(kwargs, *ids.shape[:2], ids.device)


@functools.cache
def warn_training_left_to_model() -> None:
    """Once per process: a forward with gradients (training) that `single_process_positions` left to the model."""
    logger.warning(
        "hf_longctx: a training forward with left or inner padding (or a filled KV cache) runs the model's own "
        "attention and mask at sp_size=1: transformers builds a dense [S, S] mask for it. Pad on the right "
        "(tokenizer.padding_side = 'right') or pack documents."
    )


def model_attention_in_generate(handle: Any, config: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for a model's `generate`: the model's own attention implementation (`handle.kernel_name`)
    on `config` for the whole call, and `handle.generating` set so its forward hooks leave every forward alone."""

    def make(generate: Callable[..., Any]) -> Callable[..., Any]:
        def generate_with_model_attention(*args: Any, **kwargs: Any) -> Any:
            previous = config._attn_implementation_internal
            config._attn_implementation_internal = handle.kernel_name
            handle.generating += 1
            try:
                return generate(*args, **kwargs)
            finally:
                handle.generating -= 1
                config._attn_implementation_internal = previous

        return generate_with_model_attention

    return make

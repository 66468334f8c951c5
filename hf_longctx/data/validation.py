"""Input checks that fail before any attention collective, with the same `ValueError` on every SP rank.

A malformed batch must not leave one rank raising while its peers wait inside an all-to-all. So each
check is decided from data every rank of the SP group has:

- `check_batch_layout` is pure and runs on the full batch before sharding (every SP rank holds the
  same full batch): an empty batch, tensors whose `[batch, seq]` disagree with `input_ids`;
- `check_token_ids` and `check_positions` run in the SP forward pre-hook on every shard's
  `shard_summary` (smallest and largest token id, largest position of a real token), which rides along
  the one fixed-size all-gather of the batch signature (`data.consistency`);
- `check_loader_not_empty` refuses a DataLoader with no batch before training starts.

`ModelLimits.of(model)` reads the limits once, when SP is enabled on a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Keys that must be `[batch, seq]` like `input_ids` (position_ids may also be `[1, seq]`).
_SEQUENCE_KEYS = ("attention_mask", "labels", "shift_labels", "position_ids")
# RoPE variants that rescale themselves for any length: no fixed limit.
_UNBOUNDED_ROPE = ("dynamic",)


def check_batch_layout(batch: Mapping[str, Any], bs: int, sl: int) -> None:
    """Raise unless the batch has tokens and every sequence tensor is `[bs, sl]` like `input_ids`.

    Raises:
        ValueError: an empty batch, or naming the tensor whose shape disagrees and both shapes.
    """
    if bs == 0 or sl == 0:
        raise ValueError(
            f"The batch is empty ({bs} rows x {sl} tokens): the dataset (or what the collator kept of it) has no "
            "tokens. Check that the dataset is not empty and that filtering/truncation left tokens in every sample."
        )
    for key in _SEQUENCE_KEYS:
        value = batch.get(key)
        if not isinstance(value, torch.Tensor) or (key == "attention_mask" and value.dim() != 2):
            continue  # a 4-D mask is refused by `check_right_padding`, with its own fix
        shapes = ((bs, sl), (1, sl), (sl,)) if key == "position_ids" else ((bs, sl),)
        if tuple(value.shape) not in shapes:
            raise ValueError(
                f"{key} has shape {tuple(value.shape)} but input_ids has ({bs}, {sl}): every [batch, seq] tensor "
                f"of a batch must match input_ids. Fix the collator so that {key} is padded like input_ids."
            )


def shard_summary(
    input_ids: torch.Tensor | None, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`[min id, max id, max position]` of a shard (int64): what the input checks need from every rank.

    Ids are `[0, -1]` when there are none (`inputs_embeds`). The position is that of the last real token:
    with a 2-D `attention_mask`, the padding added for the SP size (its positions continue past the
    sequence) does not count; -1 when the shard holds no real token. Tensor operations only (no host
    sync): under `torch.compile` the one host decision stays where the all-gathered table is read.
    """
    device = position_ids.device
    if input_ids is None or input_ids.numel() == 0 or input_ids.is_floating_point():
        ids = torch.tensor([0, -1], dtype=torch.int64, device=device)
    else:
        ids = torch.stack([input_ids.min(), input_ids.max()]).to(device=device, dtype=torch.int64)
    positions = position_ids.to(torch.int64)
    if attention_mask is not None and attention_mask.shape == position_ids.shape:
        positions = torch.where(attention_mask.to(device).bool(), positions, torch.full_like(positions, -1))
    top = positions.max().reshape(1) if positions.numel() else torch.full((1,), -1, dtype=torch.int64, device=device)
    return torch.cat([ids, top])


@dataclass(frozen=True)
class ModelLimits:
    """What the model can embed: rows of its token embedding and the largest position it supports."""

    vocab_rows: int | None
    max_positions: int | None
    model_name: str

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelLimits:
        """Read the limits of a transformers model (None where the model does not say)."""
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        rows = getattr(embeddings, "num_embeddings", None)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        return cls(rows, position_limit(config), type(model).__name__)


def position_limit(config: Any) -> int | None:
    """The number of positions the model supports: `max_position_embeddings`, or the RoPE scaling's
    `factor x original_max_position_embeddings` when larger (YaRN, LongRoPE and linear configs often keep
    `max_position_embeddings` at the pretraining length); None for dynamic RoPE or when unknown."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    params = getattr(config, "rope_parameters", None) or {}
    # Models with per-layer-type RoPE (e.g. Gemma 3) keep one dict per layer type.
    variants = params.values() if params and all(isinstance(v, Mapping) for v in params.values()) else [params]
    for rope in variants:
        if not isinstance(rope, Mapping):
            continue
        if rope.get("rope_type") in _UNBOUNDED_ROPE:
            return None
        factor, original = rope.get("factor"), rope.get("original_max_position_embeddings")
        if isinstance(factor, (int, float)) and isinstance(original, int):
            limit = max(limit, int(factor * original))
    return limit


def check_token_ids(summaries: Sequence[Sequence[int]], limits: ModelLimits) -> None:
    """Raise when a token id is negative or not below the embedding rows.

    Args:
        summaries: the `shard_summary` of every SP rank's shard, as lists of ints in rank order.
        limits: the model's limits.

    Raises:
        ValueError: naming the id, the SP rank whose shard holds it and the vocabulary size.
    """
    if limits.vocab_rows is None:
        return
    for rank, (lo, hi, _) in enumerate(summaries):
        if hi < lo:
            continue
        bad = lo if lo < 0 else hi if hi >= limits.vocab_rows else None
        if bad is not None:
            raise ValueError(
                f"input_ids hold token id {bad} (in SP rank {rank}'s shard), outside the vocabulary of "
                f"{limits.model_name} ({limits.vocab_rows} embedding rows, ids 0..{limits.vocab_rows - 1}). The "
                "tokenizer and the model disagree (resize the embeddings with model.resize_token_embeddings(len("
                "tokenizer))), or the collator put a label value such as -100 into input_ids."
            )


def check_positions(summaries: Sequence[Sequence[int]], limits: ModelLimits) -> None:
    """Raise when the position of a real token reaches the model's limit (`position_limit`).

    Args:
        summaries: the `shard_summary` of every SP rank's shard, as lists of ints in rank order.
        limits: the model's limits.

    Raises:
        ValueError: naming the largest position and the limit, and the fixes.
    """
    top = max((summary[2] for summary in summaries), default=-1)
    if limits.max_positions is not None and top >= limits.max_positions:
        raise ValueError(
            f"A sequence reaches position {top}, but {limits.model_name} supports {limits.max_positions} positions "
            "(config.max_position_embeddings, or its RoPE scaling). Cut sequences to at most "
            f"{limits.max_positions} tokens (max_length) or pack shorter documents, or extend the model's context "
            "(rope scaling and max_position_embeddings in its config) before training."
        )


def check_inputs(summaries: Sequence[Sequence[int]], limits: ModelLimits) -> None:
    """`check_token_ids` then `check_positions` on every SP rank's `shard_summary`."""
    check_token_ids(summaries, limits)
    check_positions(summaries, limits)


def check_loader_not_empty(data_loader: Any) -> None:
    """Raise when a DataLoader over a sized dataset yields no batch (an IterableDataset cannot be checked).

    Raises:
        ValueError: naming the dataset size and the batch settings.
    """
    dataset = getattr(data_loader, "dataset", None)
    try:
        rows, batches = len(dataset), len(data_loader)
    except TypeError:  # an IterableDataset has no length
        return
    if batches == 0:
        batch_size = getattr(data_loader, "batch_size", None)
        drop_last = getattr(data_loader, "drop_last", False)
        raise ValueError(
            f"The DataLoader yields no batch: its dataset has {rows} rows (batch size {batch_size}, drop_last="
            f"{drop_last}). Pass a dataset with at least one full batch of samples; an empty dataset cannot be "
            "trained or evaluated under sequence parallelism."
        )

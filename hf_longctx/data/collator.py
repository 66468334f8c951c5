"""`SequenceShardingCollator`: wraps any collate function so each rank receives its sequence shard.

Sharding inside the collate function (instead of wrapping the DataLoader) keeps every DataLoader
feature that rebuilds loaders from their `collate_fn` — accelerate's `skip_first_batches` on
resume, worker processes, stateful loaders — and keeps the shard pure (no collectives here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hf_longctx.data.consistency import ORIGINAL_LABELS_KEY, SIGNATURE_KEY, batch_signature
from hf_longctx.data.layout import LAYOUT_KEY
from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.distributed.layout_slot import LayoutSlot


class SequenceShardingCollator:
    """`collate_fn(features)` then keep rank `sp_rank`'s slice of every sequence tensor.

    The shard carries `labels` = `shift_labels` (pre-shifted on the full sequence; HF losses and
    TRL use `shift_labels` as-is and Trainer counts them; a token-classification model's per-token
    `labels` are sliced as they are instead), an `attention_mask` that is 0 on the
    padding added for the SP size, the full batch's signature for the cross-rank check, and this
    rank's slice of the unshifted labels (what evaluation returns as `label_ids`). The token layout
    is read from `layout` (the groups' `layout_slot`) at every call: the Trainer builds its
    dataloader before the model is prepared and the backend has claimed the layout.
    """

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any],
        sp_rank: int,
        sp_world_size: int,
        pad_token_id: int = 0,
        layout: LayoutSlot | None = None,
    ):
        self.collate_fn, self.sp_rank, self.sp_world_size = collate_fn, sp_rank, sp_world_size
        self.pad_token_id = pad_token_id
        self.layout = layout if layout is not None else LayoutSlot()

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch = self.collate_fn(features)
        if not isinstance(batch, Mapping):
            raise ValueError(
                f"Sequence parallelism needs a collator that returns a dict of tensors, got {type(batch).__name__}."
            )
        batch = dict(batch)
        signature = batch_signature(batch)
        if "attention_mask" not in batch and isinstance(batch.get("input_ids"), torch.Tensor):
            # Padding-free batches have no mask; one of ones lets Trainer/TRL count real tokens exactly.
            batch["attention_mask"] = torch.ones_like(batch["input_ids"], dtype=torch.long)
        if isinstance(batch.get("labels"), torch.Tensor):
            batch[ORIGINAL_LABELS_KEY] = batch["labels"]  # sliced like every sequence tensor
        kind = self.layout.kind
        shard = shard_batch_for_rank(
            batch,
            self.sp_rank,
            self.sp_world_size,
            pad_token_id=self.pad_token_id,
            layout=kind,
            labels=self.layout.labels,
        )
        if "shift_labels" in shard:
            shard["labels"] = shard["shift_labels"]
        shard[SIGNATURE_KEY] = signature
        if self.sp_world_size > 1:
            shard[LAYOUT_KEY] = kind
        return shard

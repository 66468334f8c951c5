"""Batch sharding with cross-rank checks: `shard_batch` is the main entry.

The pure slicing lives in `sharding.py`; this module adds the one collective that turns a rank
desync (different samples, shapes or dtypes inside an SP group) into a `ValueError` on every
rank instead of a hang or a silently wrong loss inside the attention all-to-all.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

import torch

from ..comm import all_gather_stacked
from ..groups import SequenceParallelGroups
from .layout import LAYOUT_KEY
from .sharding import shard_batch_for_rank

_SIGNATURE_FIELDS = ("keys/dtypes/shapes", "batch size", "sequence length", "input_ids checksum")
# A batch may carry its full-batch signature under this key; the model pre-hook pops and checks it.
SIGNATURE_KEY = "hf_longctx_batch_signature"
# The Trainer collator also keeps this rank's slice of the unshifted labels here, so that evaluation returns
# the labels a run without SP returns (`labels` itself holds the pre-shifted ones the loss needs).
ORIGINAL_LABELS_KEY = "hf_longctx_labels"
# Keys the model never sees: the SP forward pre-hook removes them (LAYOUT_KEY: a zigzag shard's layout name).
PRIVATE_KEYS = (SIGNATURE_KEY, ORIGINAL_LABELS_KEY, LAYOUT_KEY)


def batch_signature(batch: Mapping[str, Any]) -> torch.Tensor:
    """A small int64 fingerprint of a batch: key names, dtypes, shapes and the token content."""
    layout = ";".join(
        f"{k}:{v.dtype}:{tuple(v.shape)}" for k, v in sorted(batch.items()) if isinstance(v, torch.Tensor)
    )
    ids = batch.get("input_ids")
    if ids is None:
        ids = batch.get("inputs_embeds")
    bs, sl = (ids.shape[0], ids.shape[1]) if ids is not None else (-1, -1)
    checksum = 0
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64, device=ids.device)
        checksum = int((ids.reshape(-1).to(torch.int64) * weights).sum())
    return torch.tensor([zlib.crc32(layout.encode()), bs, sl, checksum], dtype=torch.int64)


def _raise_on_mismatch(values: torch.Tensor, fields: tuple[str, ...], groups: SequenceParallelGroups) -> None:
    # One all-gather of a fixed-size tensor: it cannot hang on mismatched shapes.
    table = all_gather_stacked(values, groups.sp_group).cpu()
    differs = [name for i, name in enumerate(fields) if bool((table[:, i] != table[0, i]).any())]
    if differs:
        per_rank = {r: table[r].tolist() for r in range(groups.sp_world_size)}
        raise ValueError(
            f"Sequence-parallel ranks hold different batches ({', '.join(differs)} differ; per SP rank "
            f"{list(fields)}: {per_rank}). Every rank of an SP group must read the same samples: "
            "use a sampler seeded identically and sharded by DP rank only."
        )


def check_batch_consistency(batch: Mapping[str, Any], groups: SequenceParallelGroups) -> None:
    """Raise on every rank when the SP ranks of a group do not hold the same full batch.

    Raises:
        ValueError: naming which property differs and each rank's value.
    """
    if groups.sp_enabled:
        _raise_on_mismatch(batch_signature(batch), _SIGNATURE_FIELDS, groups)


def check_shard_consistency(
    position_ids: torch.Tensor, signature: torch.Tensor | None, groups: SequenceParallelGroups
) -> None:
    """Before the first collective of a forward: the shards agree in shape and come from one batch.

    Args:
        position_ids: the local `[bs, sl_l]` positions of the shard.
        signature: the full batch's `batch_signature`, when the collator attached one.
        groups: the SP groups.

    Raises:
        ValueError: naming what differs across the SP ranks.
    """
    if not groups.sp_enabled:
        return
    sig = signature.cpu() if signature is not None else torch.zeros(len(_SIGNATURE_FIELDS), dtype=torch.int64)
    shape = torch.tensor([position_ids.shape[0], position_ids.shape[-1]], dtype=torch.int64)
    values = torch.cat([sig.to(torch.int64), shape]).to(position_ids.device)
    _raise_on_mismatch(values, (*_SIGNATURE_FIELDS, "shard batch size", "shard sequence length"), groups)


def shard_batch(
    batch: Mapping[str, Any], groups: SequenceParallelGroups, *, pad_token_id: int = 0, check: bool = True
) -> dict[str, Any]:
    """The local shard of a full batch that every rank of the SP group holds identically.

    Args:
        batch: a collated batch with `input_ids` (or `inputs_embeds`) `[bs, sl]` and optionally
            `labels`, `shift_labels`, `attention_mask` (right padding), `position_ids` (restarting
            at 0 for packed documents) and padding-free `cu_seq_lens_*`.
        groups: the SP/DP groups.
        pad_token_id: value used to pad `input_ids` up to a multiple of the SP size.
        check: verify (one small all-gather) that all SP ranks hold the same batch.

    Returns:
        The local shard: `input_ids`, `position_ids` (global), `shift_labels` (when labels were
        given) and every other sequence tensor sliced to `sl_padded / sp`; `labels` removed. The
        token layout is the one the backend enabled on `groups` expects (`groups.layout`:
        contiguous for Ulysses, zigzag for ring/hybrid, which also names it under `LAYOUT_KEY`).

    Raises:
        ValueError: the ranks disagree on the batch, left padding, or a malformed batch.
    """
    if check:
        check_batch_consistency(batch, groups)
    layout = groups.layout
    shard = shard_batch_for_rank(batch, groups.sp_rank, groups.sp_world_size, pad_token_id=pad_token_id, layout=layout)
    if layout != "contiguous":
        shard[LAYOUT_KEY] = layout
    return shard

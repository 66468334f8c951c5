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

from hf_longctx.data.layout import LAYOUT_KEY, check_shard_layouts, layout_code
from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.data.validation import ModelLimits, check_inputs, shard_summary
from hf_longctx.distributed.comm import all_gather_stacked
from hf_longctx.distributed.groups import SequenceParallelGroups

_SIGNATURE_FIELDS = ("keys/dtypes/shapes", "batch size", "sequence length", "input_ids checksum")
# A batch may carry its full-batch signature under this key; the model pre-hook pops and checks it.
SIGNATURE_KEY = "hf_longctx_batch_signature"
# The Trainer collator also keeps this rank's slice of the unshifted labels here, so that evaluation returns
# the labels a run without SP returns (`labels` itself holds the pre-shifted ones the loss needs).
ORIGINAL_LABELS_KEY = "hf_longctx_labels"
# Keys the model never sees: the SP forward pre-hook removes them (LAYOUT_KEY: the shard's token layout).
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


def _raise_on_mismatch(
    values: torch.Tensor, fields: tuple[str, ...], groups: SequenceParallelGroups, extra: torch.Tensor | None = None
) -> list[list[int]] | None:
    # One all-gather of a fixed-size tensor: it cannot hang on mismatched shapes. `extra` rides along
    # unchecked (values that may differ per rank); every rank's copy is returned.
    n = len(fields)
    sent = values if extra is None else torch.cat([values, extra.to(values.device)])
    rows = all_gather_stacked(sent, groups.sp_group).tolist()
    differs = [name for i, name in enumerate(fields) if any(row[i] != rows[0][i] for row in rows)]
    if differs:
        per_rank = {r: row[:n] for r, row in enumerate(rows)}
        raise ValueError(
            f"Sequence-parallel ranks hold different batches ({', '.join(differs)} differ; per SP rank "
            f"{list(fields)}: {per_rank}). Every rank of an SP group must read the same samples: "
            "use a sampler seeded identically and sharded by DP rank only."
        )
    return None if extra is None else [row[n:] for row in rows]


def check_batch_consistency(
    batch: Mapping[str, Any], groups: SequenceParallelGroups, signature: torch.Tensor | None = None
) -> None:
    """Raise on every rank when the SP ranks of a group do not hold the same full batch (`signature`: the
    batch's `batch_signature`, when the caller has it already).

    Raises:
        ValueError: naming which property differs and each rank's value.
    """
    if groups.sp_enabled:
        _raise_on_mismatch(batch_signature(batch) if signature is None else signature, _SIGNATURE_FIELDS, groups)


def check_shard_consistency(
    position_ids: torch.Tensor,
    signature: torch.Tensor | None,
    groups: SequenceParallelGroups,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    limits: ModelLimits | None = None,
    *,
    layout: str | None = None,
    expected_layout: tuple[str, str] | None = None,
) -> None:
    """Before the first collective of a forward: the shards agree in shape, come from one batch, are in the
    token layout the attention expects and hold inputs the model can take.

    Args:
        position_ids: the local `[bs, sl_l]` positions of the shard.
        signature: the full batch's `batch_signature`, when the collator attached one.
        groups: the SP groups.
        input_ids, attention_mask: the shard's; with `limits` (the model's `validation.ModelLimits`) their
            `validation.shard_summary` rides along the same all-gather, so that every rank checks every
            shard's token ids and positions.
        layout: the layout the shard names under `LAYOUT_KEY` (None: it names none, i.e. contiguous slices).
        expected_layout: (layout, attention name) the model's SP attention expects; None skips the check.
            Every rank's `layout` rides along the all-gather, so a wrong shard on one rank raises on all.

    Raises:
        ValueError: naming what differs across the SP ranks, a shard in the wrong token layout, or the token
            id / position the model cannot take.
    """
    summary = None if limits is None else shard_summary(input_ids, position_ids, attention_mask)
    if not groups.sp_enabled:
        if summary is not None:
            check_inputs([summary.tolist()], limits)
        return
    sig = signature.cpu() if signature is not None else torch.zeros(len(_SIGNATURE_FIELDS), dtype=torch.int64)
    shape = torch.tensor([position_ids.shape[0], position_ids.shape[-1]], dtype=torch.int64)
    values = torch.cat([sig.to(torch.int64), shape]).to(position_ids.device)
    fields = (*_SIGNATURE_FIELDS, "shard batch size", "shard sequence length")
    extra = torch.tensor([layout_code(layout)], dtype=torch.int64, device=position_ids.device)
    if summary is not None:
        extra = torch.cat([extra, summary.to(torch.int64)])
    rows = _raise_on_mismatch(values, fields, groups, extra)
    if expected_layout is not None:
        check_shard_layouts([row[0] for row in rows], *expected_layout)
    if summary is not None:
        check_inputs([row[1:] for row in rows], limits)


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
        given) and every other sequence tensor sliced to `sl_padded / sp`; `labels` removed (kept, sliced, when
        the enabled model labels each token itself: `groups.layout_slot.labels == "per_token"`). The
        token layout is the one the backend enabled on `groups` expects (`groups.layout`:
        contiguous for Ulysses, zigzag for ring/hybrid), named under `LAYOUT_KEY` when SP is on,
        with the full batch's signature under `SIGNATURE_KEY` (the model's pre-hook pops both).

    Raises:
        ValueError: the ranks disagree on the batch, left padding, or a malformed batch.
    """
    signature = batch_signature(batch)
    if check:
        check_batch_consistency(batch, groups, signature)
    layout, labels = groups.layout, groups.layout_slot.labels
    shard = shard_batch_for_rank(
        batch, groups.sp_rank, groups.sp_world_size, pad_token_id=pad_token_id, layout=layout, labels=labels
    )
    if groups.sp_enabled:
        shard[LAYOUT_KEY] = layout
        shard[SIGNATURE_KEY] = signature  # the model's pre-hook checks it and reads the row length before padding
    return shard

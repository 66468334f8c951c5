"""Pure functions that turn one full batch into the shard a sequence-parallel rank keeps.

`shard_batch_for_rank(batch, sp_rank, sp_world_size)` is the main one (no collectives, so it is
tested by looping over ranks in one process). Order matters: `position_ids` and `shift_labels`
are built on the FULL sequence, the sequence is padded to a multiple of the SP size, and only
then is every sequence tensor sliced. `hf_longctx.shard_batch` adds the cross-rank checks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_longctx.data.layout import layout_indices, pad_multiple
from hf_longctx.data.validation import check_batch_layout

IGNORE_INDEX = -100
# Padding-free metadata describes the *global* sequence; the attention rebuilds it from the
# all-gathered position ids, so the per-batch copies are dropped rather than sliced.
PACKING_METADATA_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Images and videos of a vision-language batch stay whole on every SP rank (`hf_longctx.multimodal`), whatever
# their shape happens to be.
VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts",
               "image_sizes")  # fmt: skip


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Mark where a document starts: the first token, and wherever positions do not advance by one.

    Args:
        position_ids: `[bs, sl]` integer positions; packed documents restart their positions.

    Returns:
        Boolean `[bs, sl]`, True at the first token of every document.
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Positions `[1, seq_len]` restarting at 0 at every boundary of a padding-free row."""
    lengths = cu_seqlens.diff().tolist()
    pos = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]) if lengths else torch.empty(0)
    if pos.numel() != seq_len:
        raise ValueError(f"cu_seq_lens covers {pos.numel()} tokens but the row has {seq_len}.")
    return pos.unsqueeze(0)


def position_ids_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 wherever `seq_idx` `[bs, S]` (one id per packed document, as transformers'
    `DataCollatorWithFlattening(return_seq_idx=True)` gives) changes."""
    index = torch.arange(seq_idx.shape[-1], device=seq_idx.device).expand_as(seq_idx)
    start = torch.ones_like(seq_idx, dtype=torch.bool)
    start[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return index - torch.where(start, index, torch.zeros_like(index)).cummax(-1).values


def document_positions(batch: dict[str, Any], bs: int, sl: int, device: torch.device) -> torch.Tensor:
    """`[bs, sl]` positions restarting at 0 at every packed document: `position_ids`, else from `seq_idx`, else from
    `cu_seq_lens_q` (one row; transformers' `DataCollatorWithFlattening` sends either instead), else `arange`.

    Raises:
        ValueError: `cu_seq_lens_q` without `position_ids` for a batch of several rows.
    """
    pos = batch.get("position_ids")
    if pos is None and isinstance(batch.get("seq_idx"), torch.Tensor):
        pos = position_ids_from_seq_idx(batch["seq_idx"].to(device).expand(bs, sl))
    if pos is None and batch.get("cu_seq_lens_q") is not None:
        if bs != 1:
            raise ValueError(
                f"cu_seq_lens_q describes one padding-free row, but the batch has {bs} rows; pass position_ids."
            )
        pos = position_ids_from_cu_seqlens(batch["cu_seq_lens_q"].cpu(), sl).to(device)
    if pos is None:
        pos = torch.arange(sl, dtype=torch.long, device=device)
    return pos.to(torch.long).expand(bs, sl)


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a 2-D mask is ones followed by zeros."""
    if attention_mask.dim() != 2:
        return False
    m = attention_mask.to(torch.int64)
    return not bool((m[:, 1:] > m[:, :-1]).any())


def check_right_padding(attention_mask: torch.Tensor) -> None:
    """Raise unless every row of a 2-D mask is ones followed by zeros (right padding).

    Raises:
        ValueError: left or inner padding, which sharding would place before real tokens.
    """
    if attention_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D [batch, seq] under sequence parallelism, got shape "
            f"{tuple(attention_mask.shape)}; for packed documents pass position_ids that restart at 0 instead."
        )
    if not right_padded(attention_mask):
        raise ValueError(
            "Left (or inner) padding found in attention_mask; sequence parallelism needs right padding: "
            "set tokenizer.padding_side = 'right' (or pack documents with restarting position_ids)."
        )


def make_shift_labels(
    labels: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Labels shifted left by one on the full sequence: token t is trained to predict t+1.

    A position gets `IGNORE_INDEX` when it is the last of the row, the last of a packed document
    (the next token starts another document) or followed by padding.

    Args:
        labels: `[bs, sl]` unshifted labels (`IGNORE_INDEX` where no loss is wanted).
        position_ids: `[bs, sl]` positions, used to find document boundaries.
        attention_mask: optional `[bs, sl]` 0/1 padding mask.

    Returns:
        `[bs, sl]` int64 shift labels.
    """
    shift = torch.full_like(labels, IGNORE_INDEX, dtype=torch.long)
    shift[:, :-1] = labels[:, 1:]
    cut = document_starts(position_ids)[:, 1:]
    if attention_mask is not None:
        cut = cut | (attention_mask[:, 1:] == 0)
    shift[:, :-1] = shift[:, :-1].masked_fill(cut, IGNORE_INDEX)
    return shift


def _pad_seq(x: torch.Tensor, pad: int, value: int | float) -> torch.Tensor:
    if pad == 0:
        return x
    fill = torch.full((x.shape[0], pad, *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, fill], dim=1)


def _continue_positions(position_ids: torch.Tensor, pad: int) -> torch.Tensor:
    # Padding extends the last document, after every real token, so causality hides it.
    if pad == 0:
        return position_ids
    step = torch.arange(1, pad + 1, dtype=position_ids.dtype, device=position_ids.device)
    return torch.cat([position_ids, position_ids[:, -1:] + step], dim=1)


def _batch_shape(batch: Mapping[str, Any]) -> tuple[int, int]:
    for key in ("input_ids", "inputs_embeds"):
        if isinstance(batch.get(key), torch.Tensor):
            return batch[key].shape[0], batch[key].shape[1]
    raise ValueError("The batch needs `input_ids` or `inputs_embeds` to define [batch, seq] for sharding.")


def prepare_global_batch(
    batch: Mapping[str, Any], multiple: int, *, pad_token_id: int = 0, labels: str = "next_token"
) -> tuple[dict[str, Any], list[str]]:
    """Build `position_ids` and `shift_labels` on the full sequence, then pad it to `multiple`.

    Args:
        batch: a collated batch (`input_ids` or `inputs_embeds`, optional `labels`, `shift_labels`,
            `attention_mask`, `position_ids`, padding-free `cu_seq_lens_*` and other tensors).
        multiple: the sequence length is padded up to a multiple of this.
        pad_token_id: value used to pad `input_ids`.
        labels: "next_token" (`labels` become `shift_labels`, token t trained on t + 1) or "per_token"
            (token classification: `labels` stay each token's own, padded with `IGNORE_INDEX`).

    Returns:
        The padded batch (without padding-free metadata, and without `labels` for next-token labels) and
        the names of its sequence tensors (`[bs, sl, ...]`), which are the ones to slice.

    Raises:
        ValueError: left padding, a non 2-D attention mask, no `input_ids`/`inputs_embeds`, an empty
            batch, or a sequence tensor whose `[batch, seq]` disagrees with `input_ids`.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}.")
    bs, sl = _batch_shape(batch)
    check_batch_layout(batch, bs, sl)
    per_token = labels == "per_token"
    out = {k: v for k, v in batch.items() if k not in PACKING_METADATA_KEYS and (per_token or k != "labels")}
    mask = batch.get("attention_mask")
    if mask is not None:
        check_right_padding(mask)
    device = batch["input_ids" if "input_ids" in batch else "inputs_embeds"].device
    pos = document_positions(batch, bs, sl, device)
    out["position_ids"] = pos
    if per_token and batch.get("shift_labels") is not None:
        raise ValueError(
            "This model's head labels every token itself (token classification), but the batch carries "
            "shift_labels (next-token targets): pass per-token `labels` only."
        )
    if not per_token and batch.get("shift_labels") is None and batch.get("labels") is not None:
        out["shift_labels"] = make_shift_labels(batch["labels"], pos.to(batch["labels"].device), mask)

    pad = -sl % multiple
    seq_keys = [k for k, v in out.items() if k not in VISION_KEYS and isinstance(v, torch.Tensor) and v.dim() >= 2
                and v.shape[:2] == (bs, sl)]  # fmt: skip
    fills = {"input_ids": pad_token_id, "shift_labels": IGNORE_INDEX, "labels": IGNORE_INDEX}
    for key in seq_keys:
        if key == "position_ids":
            out[key] = _continue_positions(out[key], pad)
        else:
            out[key] = _pad_seq(out[key], pad, fills.get(key, 0))
    return out, seq_keys


def shard_tensor(
    x: torch.Tensor, sp_rank: int, sp_world_size: int, dim: int = 1, layout: str = "contiguous"
) -> torch.Tensor:
    """Return rank `sp_rank`'s part of `x` along `dim` in `layout` (a copy, never a view)."""
    size = x.shape[dim]
    if size % pad_multiple(layout, sp_world_size) != 0:
        raise ValueError(
            f"Sequence length {size} is not divisible by {pad_multiple(layout, sp_world_size)} "
            f"(sp_world_size={sp_world_size}, {layout} layout)."
        )
    if layout != "contiguous":
        return x.index_select(dim, layout_indices(layout, sp_rank, sp_world_size, size).to(x.device))
    chunk = size // sp_world_size
    return x.narrow(dim, sp_rank * chunk, chunk).clone(memory_format=torch.contiguous_format)


def shard_batch_for_rank(
    batch: Mapping[str, Any],
    sp_rank: int,
    sp_world_size: int,
    *,
    pad_token_id: int = 0,
    layout: str = "contiguous",
    labels: str = "next_token",
) -> dict[str, Any]:
    """The shard of `batch` kept by `sp_rank` (pure: no collectives).

    Args:
        batch: the full batch, identical on every rank of the SP group.
        sp_rank: this rank's index in its SP group.
        sp_world_size: the SP group size.
        pad_token_id: value used to pad `input_ids`.
        layout: "contiguous" (Ulysses) or "zigzag" (ring/hybrid: padded to 2 x sp_world_size, rank p
            keeps chunks p and 2P-1-p of 2P), see `hf_longctx.data.layout`.
        labels: "next_token" or "per_token", see `prepare_global_batch`.

    Returns:
        A dict with every sequence tensor sliced to `[bs, sl / sp_world_size, ...]` (after padding),
        global `position_ids`, `shift_labels` when labels were given (next-token labels; per-token `labels`
        are sliced as they are), padding-free metadata removed, and non-sequence entries passed through
        untouched.

    Raises:
        ValueError: see `prepare_global_batch`; or `sp_rank` out of range.
    """
    if not 0 <= sp_rank < sp_world_size:
        raise ValueError(f"sp_rank={sp_rank} is outside [0, {sp_world_size}).")
    multiple = pad_multiple(layout, sp_world_size)
    full, seq_keys = prepare_global_batch(batch, multiple, pad_token_id=pad_token_id, labels=labels)
    for key in seq_keys:
        full[key] = shard_tensor(full[key], sp_rank, sp_world_size, layout=layout)
    return full

"""3-D (mRoPE) positions of packed rows, per document, for Qwen2.5-VL / Qwen3-VL style models.

transformers computes these positions per row (`get_rope_index` counts on from the row's first token) and, given
packed 1-D `position_ids`, uses those for every axis: neither is what each document gets when it is run alone.
`document_rope_positions` (the main function) calls the model's own `get_rope_index` on each document alone (its
tokens and, in row order, the grids of its images and videos) and concatenates the results, so a packed row
trains every document with the positions it has as a single-document row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_longctx.data.sharding import document_starts

_IMAGE, _VIDEO = 1, 2  # `mm_token_type_ids` values (text is 0)


def document_spans(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of `[bs, sl]` positions, the `[start, end)` ranges of its documents (positions restart at each)."""
    sl, rows = position_ids.shape[1], []
    for starts in document_starts(position_ids):
        bounds = torch.nonzero(starts).flatten().tolist() + [sl]
        rows.append(list(zip(bounds[:-1], bounds[1:], strict=True)))
    return rows


def _media_documents(valid: torch.Tensor, spans: list[tuple[int, int]]) -> list[tuple[int, int, dict[int, int]]]:
    """The documents of one row holding image or video tokens, with their counts of each.

    Counted for all documents at once from cumulative sums: a row's padding often restarts positions at every
    token, so it can hold thousands of one-token "documents", and per-document tensor work would cost seconds.
    Text-only documents keep their 1-D positions on every axis, as the model gives a row without images.
    """
    if not spans:
        return []
    bounds = torch.tensor(spans, dtype=torch.long, device=valid.device)  # [docs, 2]
    counts = {}
    for kind in (_IMAGE, _VIDEO):
        csum = torch.nn.functional.pad((valid == kind).long().cumsum(0), (1, 0))
        counts[kind] = (csum[bounds[:, 1]] - csum[bounds[:, 0]]).tolist()
    media = [i for i, (n_img, n_vid) in enumerate(zip(counts[_IMAGE], counts[_VIDEO], strict=True)) if n_img or n_vid]
    return [(*spans[i], {kind: counts[kind][i] for kind in counts}) for i in media]


def take_grids(grids: torch.Tensor, first: int, tokens: int, merge: int) -> int:
    """The index after the grids, from `first` on, whose placeholder tokens add up to `tokens`.

    Each grid `(t, h, w)` stands for `t * h * w / merge**2` tokens of the row (the vision tower merges
    `merge x merge` patches into one token).

    Raises:
        ValueError: the grids do not add up to `tokens`: an image or video crosses a document boundary, or the
            row holds more placeholder tokens than the grids describe.
    """
    end, total = first, 0
    while total < tokens and end < len(grids):
        total += int(grids[end].prod()) // merge**2
        end += 1
    if total != tokens:
        raise ValueError(
            f"A packed document holds {tokens} image or video tokens, but the next grids of the batch describe "
            f"{total}: an image or video crosses a document boundary (position_ids restart inside it), or "
            "image_grid_thw / video_grid_thw do not match the placeholder tokens."
        )
    return end


def document_rope_positions(
    model: torch.nn.Module, batch: Mapping[str, Any], position_ids: torch.Tensor
) -> torch.Tensor:
    """`[4, bs, sl]` positions of a packed batch: row 0 the 1-D `position_ids` (transformers reads packed documents
    from it), rows 1-3 each document's mRoPE positions as `model.get_rope_index` gives them for that document alone,
    offset by the document's first position (0 where positions restart at 0).

    Args:
        model: the multimodal model (it owns `get_rope_index` and `config.vision_config.spatial_merge_size`).
        batch: the full rows' `input_ids` and, where present, `mm_token_type_ids`, `attention_mask`,
            `image_grid_thw`, `video_grid_thw` and `second_per_grid_ts` (grids of the whole batch, in row order).
        position_ids: `[bs, sl]` positions restarting at every document.

    Returns:
        Long `[4, bs, sl]` on `position_ids`' device. Without `mm_token_type_ids` or grids the model computes no
        mRoPE either, and every axis holds `position_ids`; so do documents without image or video tokens.

    Raises:
        ValueError: see `take_grids`.
    """
    out = position_ids.long().unsqueeze(0).repeat(4, 1, 1)
    types = batch.get("mm_token_type_ids")
    grids = {_IMAGE: batch.get("image_grid_thw"), _VIDEO: batch.get("video_grid_thw")}
    if types is None or all(g is None for g in grids.values()):
        return out
    ids, mask, seconds = batch["input_ids"], batch.get("attention_mask"), batch.get("second_per_grid_ts")
    merge = model.config.vision_config.spatial_merge_size
    valid = types if mask is None else types.masked_fill(mask == 0, 0)
    used = {_IMAGE: 0, _VIDEO: 0}
    for b, spans in enumerate(document_spans(position_ids)):
        for start, end, counts in _media_documents(valid[b], spans):
            doc: dict[str, Any] = {}
            for kind, key in ((_IMAGE, "image_grid_thw"), (_VIDEO, "video_grid_thw")):
                if counts[kind]:
                    last = take_grids(grids[kind], used[kind], counts[kind], merge)
                    doc[key] = grids[kind][used[kind] : last]
                    if kind == _VIDEO and seconds is not None:
                        doc["second_per_grid_ts"] = seconds[used[kind] : last]
                    used[kind] = last
            rope, _ = model.get_rope_index(
                input_ids=ids[b : b + 1, start:end],
                mm_token_type_ids=types[b : b + 1, start:end],
                attention_mask=None if mask is None else mask[b : b + 1, start:end],
                **doc,
            )
            out[1:, b, start:end] = rope[:, 0].to(out.device) + position_ids[b, start]
    for kind, n in used.items():
        if grids[kind] is not None and n != len(grids[kind]):
            raise ValueError(f"{len(grids[kind]) - n} image or video grids of the batch have no tokens in its rows.")
    return out

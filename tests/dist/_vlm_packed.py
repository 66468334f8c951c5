"""Packed rows of tiny Qwen2.5-VL / Qwen3-VL documents, as TRL's collators lay them out, and each document alone.

A document is `(length, images, seed)` (`_vlm.row`: token ids and image grids; its image patches from its own seed).
Two layouts, both with `position_ids` restarting at 0 at every document and the label of each document's first
token set to -100 (TRL's padding-free collator does so; it also keeps a document's last token from predicting
the next document's first):

- `padding_free`: one row of three documents, no `attention_mask` (`DataCollatorForLanguageModeling(
  padding_free=True)`, which `SFTConfig(packing=True)` turns on);
- `packed_mask`: two packed rows right-padded with `attention_mask` 0 and `position_ids` 0 (the same collator with
  `return_position_ids=True`, which TRL sets under sequence parallelism).

Images straddle the shard boundaries: 45 tokens (SP=2: 23; SP=4 and SP=2 zigzag: 12, 24, 36) and 40 (20; 10, 20, 30).
"""

from __future__ import annotations

import torch

from tests.dist import _vlm as V

Doc = tuple[int, list[tuple[int, tuple[int, int]]], int]

# A: an image; B: text only; C: two images, the first across 23 and 24, the second across 36.
PADDING_FREE: list[list[Doc]] = [[(14, [(3, (4, 4))], 21), (6, [], 22), (25, [(2, (4, 6)), (14, (4, 4))], 23)]]
# Row 0: an image across 10 (SP=4), one across 20 (SP=2, 4); row 1: text only, then a document with two images.
PACKED_MASK: list[list[Doc]] = [
    [(16, [(9, (4, 4))], 24), (19, [(3, (6, 4))], 25)],
    [(12, [], 26), (22, [(2, (4, 4)), (10, (4, 4))], 27)],
]


def _pixels(doc: Doc) -> torch.Tensor:
    _, images, seed = doc
    patches = sum(h * w for _, (h, w) in images)
    return torch.randn(patches, V.PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def document(doc: Doc) -> dict[str, torch.Tensor]:
    """The document alone, as a single-document row (no packing, no padding)."""
    ids, grids = V.row(doc[0], doc[1], seed=doc[2])
    out = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": (torch.tensor([ids]) == V.IMAGE).long()}
    if grids:
        out["pixel_values"], out["image_grid_thw"] = _pixels(doc), torch.tensor(grids)
    return out


def pack(rows: list[list[Doc]], pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """The documents packed into rows: `position_ids` restart per document; with `pad_to`, right padding and an
    `attention_mask` (padding: id 0, position 0, label -100)."""
    length = pad_to or max(sum(d[0] for d in docs) for docs in rows)
    ids, pos, mask = (torch.zeros(len(rows), length, dtype=torch.long) for _ in range(3))
    grids, pixels = [], []
    for b, docs in enumerate(rows):
        start = 0
        for doc in docs:
            tokens, doc_grids = V.row(doc[0], doc[1], seed=doc[2])
            ids[b, start : start + doc[0]] = torch.tensor(tokens)
            pos[b, start : start + doc[0]] = torch.arange(doc[0])
            mask[b, start : start + doc[0]] = 1
            grids += doc_grids
            pixels += [_pixels(doc)] if doc_grids else []
            start += doc[0]
    labels = ids.masked_fill((mask == 0) | (ids == V.IMAGE) | (pos == 0), -100)
    out = {"input_ids": ids, "position_ids": pos, "labels": labels, "mm_token_type_ids": (ids == V.IMAGE).long()}
    if pad_to is not None:
        out["attention_mask"] = mask
    out["pixel_values"], out["image_grid_thw"] = torch.cat(pixels), torch.tensor(grids)
    return out


def cases() -> dict[str, dict[str, torch.Tensor]]:
    """The packed batches of the tests, by name."""
    return {"padding_free": pack(PADDING_FREE), "packed_mask": pack(PACKED_MASK, pad_to=40)}


def layouts() -> dict[str, list[list[Doc]]]:
    """The documents of each case, row by row."""
    return {"padding_free": PADDING_FREE, "packed_mask": PACKED_MASK}

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
A third, padding-free row holds an image and two videos (Qwen2.5-VL: with their `second_per_grid_ts`).
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


def video_document(arch: str, frames: int, seed: int, seconds: float) -> dict[str, torch.Tensor]:
    """Text, a `frames`-frame video of 4 x 4 patches per frame, text; alone. Qwen3-VL writes each frame as its own
    span after a timestamp token, Qwen2.5-VL the whole video as one span (and takes `second_per_grid_ts`)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 140, (3,), generator=gen).tolist()
    if arch == "qwen3_vl":
        ids += [7, V.START, *[V.VIDEO] * 4, V.END] * frames
    else:
        ids += [V.START, *[V.VIDEO] * 4 * frames, V.END]
    ids = torch.tensor([[*ids, 9, 10]])
    out = {"input_ids": ids, "mm_token_type_ids": (ids == V.VIDEO).long() * 2,
           "video_grid_thw": torch.tensor([[frames, 4, 4]]),
           "pixel_values_videos": torch.randn(frames * 16, V.PATCH_DIM, generator=gen)}  # fmt: skip
    if arch == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([seconds])
    return out


def _videos(arch: str) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """One padding-free row: an image, a 2-frame video (across 24, SP=2), a 3-frame video (across 36 or 45);
    the packed batch and its documents alone."""
    docs = [document(PADDING_FREE[0][0]), video_document(arch, 2, 41, 0.5), video_document(arch, 3, 42, 2.0)]
    return flatten(docs), docs


def flatten(docs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Single-document rows (`document`, `video_document`) as one padding-free row: `position_ids` restart per
    document, the first label of each and every image / video token -100, the media of all in row order."""
    ids = torch.cat([d["input_ids"] for d in docs], 1)
    pos = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]
    labels = ids.masked_fill((ids == V.IMAGE) | (ids == V.VIDEO) | (pos == 0), -100)
    types = torch.cat([d["mm_token_type_ids"] for d in docs], 1)
    out = {"input_ids": ids, "position_ids": pos, "labels": labels, "mm_token_type_ids": types}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if any(key in d for d in docs):
            out[key] = torch.cat([d[key] for d in docs if key in d])
    return out


def cases(arch: str) -> dict[str, dict[str, torch.Tensor]]:
    """The packed batches of the tests, by name."""
    return {"padding_free": pack(PADDING_FREE), "packed_mask": pack(PACKED_MASK, pad_to=40), "videos": _videos(arch)[0]}


def documents(arch: str) -> dict[str, list[list[dict[str, torch.Tensor]]]]:
    """Each case's documents alone, row by row (padding left out)."""
    alone = {name: [[document(doc) for doc in docs] for docs in rows] for name, rows in
             (("padding_free", PADDING_FREE), ("packed_mask", PACKED_MASK))}  # fmt: skip
    return {**alone, "videos": [_videos(arch)[1]]}

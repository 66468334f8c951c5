"""Vision-language configs in `hf-longctx check`: a small vision tower, image rows, the VLM reference.

Two image layouts are supported:

- "qwen" (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ...): a vision config with `patch_size`, `spatial_merge_size` and
  `temporal_patch_size`, images passed as flattened patches (`pixel_values`) with their grids
  (`image_grid_thw`), each written in the text as `<vision_start> <image> * (patches / merge^2) <vision_end>`;
  its patch, merge and temporal sizes are kept, since they set how images map to tokens;
- "llava" (`model_type == "llava"`): a CLIP-style tower on square images, the placeholder expanded to one
  token per patch (plus the CLS feature with `vision_feature_select_strategy="full"`); the test copy's
  images are 4 x 4 pixels of 2 x 2 patches (4 tokens).

With `--packed` (Qwen layout) each row holds three documents, no image across their boundaries, and the
reference runs every document alone with its images (`reference_outputs`). Other VLMs are refused by name: the
check does not build their batches. The vision tower of the test copy is shrunk to 2 blocks of width 32
(2 heads). Under SP it runs sharded (each image encoded on one rank, `hf_longctx/multimodal/vision_shard.py`);
`record_tower_rows` counts what each rank's tower received, which the report prints.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hf_longctx.multimodal.mrope import document_spans, take_grids

_GRID_KEYS = ("patch_size", "spatial_merge_size", "temporal_patch_size")
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_SMALL_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
MIN_SEQ_LEN = 24  # room for two images of 4 tokens with their start/end markers, and text around them


def is_vision_language(config: Any) -> bool:
    """True for a config with a vision tower (a `vision_config`)."""
    return getattr(config, "vision_config", None) is not None


def image_layout(config: Any) -> str:
    """ "llava" or "qwen" (module docstring).

    Raises:
        ValueError: neither, naming what the config lacks.
    """
    if config.model_type == "llava":
        return "llava"
    vision = config.vision_config
    missing = [key for key in (*_GRID_KEYS, "depth") if getattr(vision, key, None) is None]
    missing += [key for key in _TOKEN_KEYS if getattr(config, key, None) is None]
    if missing:
        raise ValueError(
            f"{type(config).__name__}: hf-longctx check builds image rows for LLaVA and for the Qwen-VL image "
            f"layout (patches + image_grid_thw); this config lacks {', '.join(missing)}. Check its decoder alone "
            "(its text_config saved as a config.json) instead."
        )
    return "qwen"


def check_supported(config: Any, seq_len: int, packed: bool) -> None:
    """Refuse, naming why, a VLM config or batch the check cannot build.

    Raises:
        ValueError: an unsupported image layout, `--packed` for LLaVA (the check's reference splits only the
            Qwen image layout per document), or a row too short.
    """
    llava = image_layout(config) == "llava"
    if llava and config.vision_feature_select_strategy not in ("default", "full"):
        raise ValueError(
            f"vision_feature_select_strategy {config.vision_feature_select_strategy!r}: the check knows 'default' "
            "and 'full'."
        )
    if packed and llava:
        raise ValueError(
            f"{type(config).__name__}: the check builds one document per row for vision-language models of the "
            "LLaVA layout. Run the check without --packed."
        )
    if seq_len < MIN_SEQ_LEN:
        raise ValueError(f"--seq-len must be >= {MIN_SEQ_LEN} for a vision-language model, got {seq_len}.")


def shrink_vision(config: Any, text_layers: int) -> list[str]:
    """Shrink `config.vision_config` in place (see the module docstring) and put the image tokens at the
    top of the (shrunk) vocabulary; returns notes on what changed."""
    if image_layout(config) == "llava":
        return _shrink_llava(config)
    vision = config.vision_config
    depth = min(int(vision.depth), 2)
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    notes = [f"vision tower {vision.depth} blocks x {width} -> {depth} x {_SMALL_VISION['hidden_size']}"]
    vision.depth = depth
    text = config.get_text_config()
    if hasattr(vision, "embed_dim"):  # Qwen2-VL: embed_dim is the tower's width, hidden_size its output
        vision.embed_dim, vision.num_heads, vision.hidden_size = 32, 2, text.hidden_size
    else:
        for key, value in _SMALL_VISION.items():
            setattr(vision, key, value)
        vision.out_hidden_size = text.hidden_size
    if getattr(vision, "fullatt_block_indexes", None):
        vision.fullatt_block_indexes = [depth - 1]
    if getattr(vision, "deepstack_visual_indexes", None):
        keep = min(len(vision.deepstack_visual_indexes), depth, text_layers)
        vision.deepstack_visual_indexes = list(range(keep))
        notes.append(f"DeepStack features from vision blocks {vision.deepstack_visual_indexes}")
    notes += _fit_mrope(text)
    vocab = int(text.vocab_size)
    for offset, key in enumerate(_TOKEN_KEYS, start=1):
        for holder in (config, text):
            if getattr(holder, key, None) is not None:
                setattr(holder, key, vocab - offset)
    notes.append(f"image tokens -> ids {vocab - len(_TOKEN_KEYS)}..{vocab - 1}")
    return notes


def _shrink_llava(config: Any) -> list[str]:
    vision = config.vision_config
    depth = min(int(vision.num_hidden_layers), 2)
    notes = [f"vision tower {vision.num_hidden_layers} layers x {vision.hidden_size} -> {depth} x 32, 4 x 4 images"]
    vision.num_hidden_layers = depth
    vision.hidden_size, vision.intermediate_size, vision.num_attention_heads = 32, 64, 2
    vision.image_size, vision.patch_size = 4, 2
    if hasattr(vision, "projection_dim"):
        vision.projection_dim = 32
    layers = config.vision_feature_layer  # indices into the tower's depth + 1 hidden states; the last if out of range
    fitted = [i if -(depth + 1) <= i <= depth else -1 for i in (layers if isinstance(layers, list) else [layers])]
    config.vision_feature_layer = fitted if isinstance(layers, list) else fitted[0]
    vocab = int(config.get_text_config().vocab_size)
    config.image_token_id = vocab - 1
    config.image_seq_length = _llava_tokens(config)
    notes.append(f"image token -> id {vocab - 1}")
    return notes


def _llava_tokens(config: Any) -> int:
    """Image tokens per image: one per patch, plus the CLS feature when the strategy keeps it."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")


def _fit_mrope(text: Any) -> list[str]:
    """Rescale the 3-D rotary sections (temporal, height, width) to a shrunk head dimension: they must sum
    to half of it."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    for key in ("rope_parameters", "rope_scaling"):
        rope = getattr(text, key, None)
        sections = rope.get("mrope_section") if isinstance(rope, dict) else None
        if not sections or 2 * sum(sections) == head_dim:
            continue
        scaled = [max(1, round(s * head_dim / (2 * sum(sections)))) for s in sections]
        scaled[-1] += head_dim // 2 - sum(scaled)
        if min(scaled) < 1:
            raise ValueError(
                f"head_dim {head_dim} is too small for the 3-D rotary sections {sections}: use a larger --hidden."
            )
        rope["mrope_section"] = scaled
        return [f"mrope_section {sections} -> {scaled}"]
    return []


def make_batch(model: torch.nn.Module, seq_len: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic image rows: row 0 holds two images, one straddling the middle of the row (the SP=2
    shard boundary) and one across the first quarter (SP=4); odd rows hold no image, even rows one.

    Labels mask the image tokens and row 0's first half (a shard with no label must still be exact);
    `mm_token_type_ids` (image tokens = 1) is added where the model's forward takes it.
    """
    config = model.config
    llava = image_layout(config) == "llava"
    vocab = int(config.get_text_config().vocab_size)
    image = config.image_token_id
    n_tokens = _llava_tokens(config) if llava else 4
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab - len(_TOKEN_KEYS), (batch_size, seq_len), generator=gen)
    images = 0
    for b in range(batch_size):
        if b % 2:
            continue
        firsts = [seq_len // 2 - n_tokens // 2, max(2, seq_len // 4 - n_tokens // 2)] if b == 0 else [seq_len // 3]
        for first in sorted(firsts):
            ids[b, first : first + n_tokens] = image
            if not llava:
                ids[b, first - 1], ids[b, first + n_tokens] = config.vision_start_token_id, config.vision_end_token_id
            images += 1
    labels = ids.masked_fill(ids == image, -100)
    labels[0, : (seq_len + 1) // 2 + 1] = -100
    batch = {"input_ids": ids, "labels": labels, **_pixels(config.vision_config, llava, images, gen)}
    if "mm_token_type_ids" in inspect.signature(type(model).forward).parameters:
        batch["mm_token_type_ids"] = (ids == image).long()
    return batch


def _pixels(vision: Any, llava: bool, images: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random images: `[images, 3, size, size]` for LLaVA; for Qwen, flattened patches of 2 x 2 merge
    units per image (4 tokens after the merge) with their grids."""
    if llava:
        return {"pixel_values": torch.randn(images, 3, vision.image_size, vision.image_size, generator=gen)}
    merge, patch, temporal = (
        int(getattr(vision, k)) for k in ("spatial_merge_size", "patch_size", "temporal_patch_size")
    )
    grid = (1, 2 * merge, 2 * merge)
    pixels = torch.randn(images * grid[1] * grid[2], 3 * temporal * patch * patch, generator=gen)
    return {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid] * images)}


def reference_outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
    """The plain model on the unpadded rows (it places the images and computes its own mRoPE positions): the
    logits and the forwards' outputs. Packed rows (`position_ids`) run document by document, each alone with its
    images (the grids and patches of its image tokens, in row order), like the text reference."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "position_ids")}
    if "position_ids" not in batch:
        output = model(**inputs)
        return output.logits, [output]
    grids, merge = inputs.pop("image_grid_thw"), model.config.vision_config.spatial_merge_size
    pixels = inputs.pop("pixel_values").split((grids.prod(-1)).tolist())
    used, outputs, rows = 0, [], []
    for b, spans in enumerate(document_spans(batch["position_ids"])):
        logits = []
        for start, end in spans:
            doc = {k: v[b : b + 1, start:end] for k, v in inputs.items()}
            last = take_grids(grids, used, int((doc["input_ids"] == model.config.image_token_id).sum()), merge)
            if last > used:
                doc["image_grid_thw"], doc["pixel_values"] = grids[used:last], torch.cat(pixels[used:last])
            outputs.append(model(**doc))
            logits.append(outputs[-1].logits)
            used = last
        rows.append(torch.cat(logits, dim=1))
    return torch.cat(rows), outputs


def record_tower_rows(model: torch.nn.Module) -> tuple[list[int], Any]:
    """The pixel rows (patches, or images for LLaVA) each call of the model's vision tower receives, after SP's
    split (register it after enabling SP); returns the list it fills and the hook's handle."""
    from hf_longctx.multimodal.vision import multimodal_model, vision_tower

    rows: list[int] = []

    def record(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        pixels = args[0] if args else next(kwargs[k] for k in ("pixel_values", "hidden_states") if k in kwargs)
        rows.append(int(pixels.shape[0]))

    return rows, vision_tower(multimodal_model(model)).register_forward_pre_hook(record, with_kwargs=True)

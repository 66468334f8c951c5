"""Tiny Qwen2.5-VL / Qwen3-VL models and image rows for the VLM tests (random init, fp32, CPU).

A row is text with images: each image is `<vision_start> <image>*n <vision_end>` where n is its grid's
patches / 4 (spatial merge 2 x 2). `pixel_values` holds one random patch vector per patch of every image,
in row order (what the Qwen processors produce).
"""

from __future__ import annotations

import torch

VOCAB, IMAGE, VIDEO, START, END = 160, 150, 151, 152, 153
PATCH_DIM = 3 * 1 * 2 * 2  # channels x temporal patch x patch x patch
_TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}  # fmt: skip
_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
           "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 1, "in_channels": 3}  # fmt: skip
_TOKENS = {"image_token_id": IMAGE, "video_token_id": VIDEO, "vision_start_token_id": START, "vision_end_token_id": END}
ARCHS = ("qwen2_5_vl", "qwen3_vl")


def build(arch: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """The tiny model of `arch`, identical in every process."""
    import transformers

    if arch == "qwen2_5_vl":
        text = {**_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
        vision = {**_VISION, "window_size": 8, "fullatt_block_indexes": [1]}
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_TOKENS)
        cls = transformers.Qwen2_5_VLForConditionalGeneration
    elif arch == "qwen3_vl":
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}
        vision = {**_VISION, "deepstack_visual_indexes": [0], "num_position_embeddings": 64}
        config = transformers.Qwen3VLConfig(
            text_config={**_TEXT, "rope_scaling": rope}, vision_config=vision, **_TOKENS
        )
        cls = transformers.Qwen3VLForConditionalGeneration
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    return cls._from_config(config, attn_implementation=attn)


def row(length: int, images: list[tuple[int, tuple[int, int]]], seed: int) -> tuple[list[int], list[tuple]]:
    """Token ids of one row with images `(start of the image tokens, (grid h, grid w))`; returns the ids
    and the grids `(1, h, w)` in row order."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 140, (length,), generator=gen)
    grids = []
    for start, (h, w) in images:
        n = h * w // 4
        ids[start - 1], ids[start : start + n], ids[start + n] = START, IMAGE, END
        grids.append((1, h, w))
    return ids.tolist(), grids


def batch(rows: list[tuple[list[int], list[tuple]]], pad_to: int, seed: int | list[int] = 0) -> dict[str, torch.Tensor]:
    """A right-padded batch with labels, `mm_token_type_ids` and the images' patches (none: no image keys)."""
    ids = torch.zeros(len(rows), pad_to, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (tokens, _) in enumerate(rows):
        ids[b, : len(tokens)], mask[b, : len(tokens)] = torch.tensor(tokens), 1
    labels = ids.masked_fill(mask == 0, -100).masked_fill(ids == IMAGE, -100)
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels, "mm_token_type_ids": (ids == IMAGE).long()}
    grids = [g for _, gs in rows for g in gs]
    if grids:  # each row's patches from its own seed: a batch's pixels do not depend on the order of its rows
        seeds = seed if isinstance(seed, list) else [seed + b for b in range(len(rows))]
        out["pixel_values"] = torch.cat([
            torch.randn(sum(t * h * w for t, h, w in gs), PATCH_DIM, generator=torch.Generator().manual_seed(s))
            for (_, gs), s in zip(rows, seeds, strict=True)])  # fmt: skip
        out["image_grid_thw"] = torch.tensor(grids)
    return out


def cases() -> dict[str, dict[str, torch.Tensor]]:
    """37-token rows: images straddling the SP=2 (19) and SP=4 (10, 20, 30) shard boundaries, two images in
    a row next to a row with none (padded), and a batch without any image."""
    straddle = row(37, [(8, (4, 4)), (17, (4, 6))], seed=1)
    return {
        "straddle": batch([straddle], 37),
        "two_rows": batch([row(37, [(3, (4, 4)), (27, (4, 4))], seed=2), row(29, [], seed=3)], 37),
        "no_image": batch([row(37, [], seed=4)], 37),
    }


class RowDataset(torch.utils.data.Dataset):
    """Rows of `row(...)` (token ids and image grids) with the seed of their image patches."""

    def __init__(self) -> None:
        specs = [[(8, (4, 4)), (17, (4, 6))], [], [(3, (4, 4)), (27, (4, 4))], [(20, (4, 4))], [], [(12, (6, 4))]]
        self.rows = [(*row(37 - 4 * (i % 2), images, seed=10 + i), i) for i, images in enumerate(specs)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        ids, grids, seed = self.rows[i]
        return {"ids": ids, "grids": grids, "seed": seed}


def collate(features: list[dict]) -> dict[str, torch.Tensor]:
    """A padded batch of `RowDataset` rows (each row's patches seeded by the row)."""
    seeds = [f["seed"] for f in features]
    return batch([(f["ids"], f["grids"]) for f in features], max(len(f["ids"]) for f in features), seed=seeds)


def trainer_worker(rank: int, world_size: int, out_dir: str, arch: str, sp_options: dict) -> dict:
    """Three SGD steps of the stock Trainer (batch 2, no clipping) at SP=world_size: the logged steps and
    every parameter's gradient in the first step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    torch.set_num_threads(1)
    parallelism = None
    if world_size > 1:
        import hf_longctx

        parallelism = hf_longctx.ParallelismConfig(sp_size=world_size, **sp_options)
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, report_to=[], disable_tqdm=True, seed=1, per_device_train_batch_size=2,
        max_steps=3, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", remove_unused_columns=False, parallelism_config=parallelism,
    )  # fmt: skip
    model = build(arch)
    first: dict[str, torch.Tensor] = {}

    class FirstGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not first:  # after DDP's reduction: what the optimizer applies
                first.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer = Trainer(model=model, args=args, train_dataset=RowDataset(), data_collator=collate,
                      callbacks=[FirstGradients()])  # fmt: skip
    trainer.train()
    logs = [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]} for h in trainer.state.log_history
            if "loss" in h]  # fmt: skip
    return {"logs": logs, "attn": model.config.get_text_config()._attn_implementation, "first_grads": first}

"""Tiny Qwen2.5-VL / Qwen3-VL / LLaVA models and image rows for the VLM tests (random init, fp32, CPU).

A Qwen row is text with images: each image is `<vision_start> <image>*n <vision_end>` where n is its grid's
patches / 4 (spatial merge 2 x 2). `pixel_values` holds one random patch vector per patch of every image,
in row order (what the Qwen processors produce). A LLaVA row holds `LLAVA_TOKENS` image tokens per image
(what its processor expands the placeholder to: one per patch of the 8 x 8 image, the CLS feature dropped)
and `pixel_values` is `[images, 3, 8, 8]`; positions are plain 1-D.
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
LLAVA_TOKENS = 16  # (image 8 / patch 2) ** 2
_CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "image_size": 8, "patch_size": 2, "projection_dim": 32}  # fmt: skip


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
    elif arch == "llava":
        config = transformers.LlavaConfig(
            text_config=transformers.LlamaConfig(**_TEXT), vision_config=transformers.CLIPVisionConfig(**_CLIP),
            image_token_id=IMAGE, vision_feature_layer=-1, vision_feature_select_strategy="default",
        )  # fmt: skip
        cls = transformers.LlavaForConditionalGeneration
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


def llava_cases() -> dict[str, dict[str, torch.Tensor]]:
    """53-token LLaVA rows: an image across the SP=2 (27) and SP=4 (28) boundaries, one across the SP=4
    boundary at 14, a right-padded row without any image; and a batch with no image."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 140, (3, 53), generator=gen)
    ids[0, 20 : 20 + LLAVA_TOKENS] = IMAGE
    ids[1, 2 : 2 + LLAVA_TOKENS] = IMAGE
    mask = torch.ones_like(ids)
    mask[2, 40:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100).masked_fill(ids == IMAGE, -100)
    pixels = torch.randn(2, 3, 8, 8, generator=gen)
    no_image = torch.randint(3, 140, (1, 53), generator=gen)
    return {
        "straddle": {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels},
        "no_image": {"input_ids": no_image, "labels": no_image.clone()},
    }


def count_patch_rows(model: torch.nn.Module) -> list[int]:
    """A list that collects the rows each call of the Qwen vision tower's patch embedding receives: what this
    rank's tower encodes (after any SP split)."""
    rows: list[int] = []
    model.model.visual.patch_embed.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    return rows


def vision_parameter(name: str) -> bool:
    """A parameter of the vision tower (Qwen's `visual`, LLaVA's `vision_tower`)."""
    return ".visual." in name or name.startswith("model.visual") or ".vision_tower." in name


def cases(arch: str = "qwen2_5_vl") -> dict[str, dict[str, torch.Tensor]]:
    """The rows of `arch`'s tests: `llava_cases()` for LLaVA, the Qwen rows below otherwise.

    37-token rows: images straddling the SP=2 (19) and SP=4 (10, 20, 30) shard boundaries, two images in
    a row next to a row with none (padded), and a batch without any image."""
    if arch == "llava":
        return llava_cases()
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
    rows = count_patch_rows(model)
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
    return {"logs": logs, "attn": model.config.get_text_config()._attn_implementation, "first_grads": first,
            "tower_rows": sum(rows)}  # fmt: skip


def sp_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], groups) -> torch.Tensor:
    """This rank's share of the SP loss of one forward on `batch` (the model under `enable_sequence_parallel`)."""
    import hf_longctx

    shard = hf_longctx.shard_batch(batch, groups)
    shift_labels = shard.pop("shift_labels")
    return hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)


def sp_mean(grads: dict[str, torch.Tensor | None], groups) -> dict[str, torch.Tensor | None]:
    """The gradients averaged over the SP group in one all-reduce, as the DP engine's would (None stays None)."""
    import torch.distributed as dist

    present = {k: g for k, g in grads.items() if g is not None}
    flat = torch.cat([g.reshape(-1) for g in present.values()])
    dist.all_reduce(flat, group=groups.sp_group)
    flat /= groups.sp_world_size
    parts = dict(zip(present, flat.split([g.numel() for g in present.values()]), strict=True))
    return {k: None if g is None else parts[k].view_as(g) for k, g in grads.items()}


def all_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient; zero where it has none (a row without images leaves the vision tower without
    gradients, in the reference as under SP)."""
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in model.named_parameters()}  # fmt: skip


def cases_worker(rank: int, world_size: int, archs: tuple[str, ...], backends: tuple[str, ...], packed: bool) -> dict:
    """Each (arch, backend, case) of `cases(arch)` (or the packed `_vlm_packed.cases(arch)`) at SP=world_size:
    rank 0 returns the SP loss and the gradients averaged over the SP group."""
    import hf_longctx
    from tests.dist import _vlm_packed

    torch.set_num_threads(1)
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    out = {}
    for arch in archs:
        for backend in backends:
            for name, batch in (_vlm_packed.cases if packed else cases)(arch).items():
                model = build(arch)
                with hf_longctx.enable_sequence_parallel(model, groups, backend):
                    loss = sp_loss(model, batch, groups)
                    loss.backward()
                summed = sp_mean(all_grads(model), groups)
                if rank == 0:
                    out[(arch, backend, name)] = (loss.item(), summed)
    return out


def compare_cases(results: dict, refs: dict) -> dict[str, float]:
    """`cases_worker` results against `refs[(arch, case)] = (loss, grads)`: the loss within LOSS_RTOL and every
    gradient within GRAD_RTOL; the worst gradient error per (arch, backend, case)."""
    from tests.dist._parity import GRAD_RTOL, LOSS_RTOL, grad_errors, loss_error

    worst = {}
    for (arch, backend, name), (loss, grads) in results.items():
        ref_loss, ref_grads = refs[(arch, name)]
        assert loss_error(loss, ref_loss) <= LOSS_RTOL, (arch, backend, name, loss, ref_loss)
        errors = grad_errors(grads, ref_grads)
        bad = {k: v for k, v in errors.items() if v > GRAD_RTOL}
        assert not bad, (arch, backend, name, bad)
        worst[f"{arch}/{backend}/{name}"] = max(errors.values())
    return worst

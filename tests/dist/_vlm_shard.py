"""Rows and workers of the sharded-vision-tower tests: videos, few images, InternVL, frozen towers, FSDP2.

A Qwen2.5-VL video is one `<vision_start> <video>*n <vision_end>` run (n = frames * h * w / 4); Qwen3-VL
writes one such run per frame (its processor separates frames by timestamps). `pixel_values_videos` holds
the frames' patches frame by frame. An InternVL image is 8 x 8 pixels of 2 x 2 patches, pixel-shuffled
(ratio 0.5) to `INTERNVL_TOKENS` tokens. Every worker counts the pixel rows its vision tower receives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_longctx.check.vlm import record_tower_rows
from tests.dist import _vlm as V

INTERNVL_TOKENS = 4


def build(arch: str) -> torch.nn.Module:
    """`_vlm.build(arch)`, plus a tiny InternVL (InternViT tower, Qwen2 decoder) and a LLaVA with a Pixtral tower
    (Mistral decoder), whose tower joins all images' patches into one sequence: it runs whole on every rank."""
    import transformers

    if arch == "pixtral":
        vision = transformers.PixtralVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=8,
            patch_size=2, head_dim=16,
        )  # fmt: skip
        config = transformers.LlavaConfig(
            text_config=transformers.MistralConfig(**V._TEXT), vision_config=vision, image_token_id=V.IMAGE,
            vision_feature_layer=-1, vision_feature_select_strategy="full",
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.LlavaForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    if arch != "internvl":
        return V.build(arch)

    vision = transformers.InternVLVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=[8, 8],
        patch_size=[2, 2],
    )  # fmt: skip
    config = transformers.InternVLConfig(
        vision_config=vision, text_config=transformers.Qwen2Config(**V._TEXT), image_token_id=V.IMAGE,
        downsample_ratio=0.5, vision_feature_layer=-1, vision_feature_select_strategy="default",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.InternVLForConditionalGeneration._from_config(config, attn_implementation="sdpa")


def tower(model: torch.nn.Module) -> torch.nn.Module:
    """The vision tower module."""
    from hf_longctx.multimodal.vision import multimodal_model, vision_tower

    return vision_tower(multimodal_model(model))


def _video_batch(arch: str, frames: int, image: bool) -> dict[str, torch.Tensor]:
    """A 61-token row: an optional 4 x 4 image at 3, then a video of `frames` 4 x 4 frames."""
    gen = torch.Generator().manual_seed(21)
    ids = torch.randint(3, 140, (61,), generator=gen)
    kind = torch.zeros_like(ids)
    pos = 2
    if image:
        ids[pos], ids[pos + 1 : pos + 5], ids[pos + 5] = V.START, V.IMAGE, V.END
        kind[pos + 1 : pos + 5] = 1
        pos += 7
    per_frame = arch == "qwen3_vl"
    for f in range(frames):
        if per_frame or f == 0:
            ids[pos] = V.START
            pos += 1
        ids[pos : pos + 4], kind[pos : pos + 4] = V.VIDEO, 2
        pos += 4
        if per_frame or f == frames - 1:
            ids[pos] = V.END
            pos += 2 if per_frame else 1  # a text token between frames (the timestamp's place)
    labels = ids.masked_fill(kind > 0, -100)
    out = {"input_ids": ids[None], "attention_mask": torch.ones_like(ids)[None], "labels": labels[None],
           "mm_token_type_ids": kind[None]}  # fmt: skip
    out["pixel_values_videos"] = torch.randn(frames * 16, V.PATCH_DIM, generator=gen)
    out["video_grid_thw"] = torch.tensor([[frames, 4, 4]])
    if image:
        out["pixel_values"] = torch.randn(16, V.PATCH_DIM, generator=gen)
        out["image_grid_thw"] = torch.tensor([[1, 4, 4]])
    return out


def _internvl_cases() -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(3, 140, (2, 37), generator=gen)
    for start in (8, 17, 30):  # three images, the middle one across the SP=2 boundary (19)
        ids[0, start : start + INTERNVL_TOKENS] = V.IMAGE
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0  # a padded text-only row
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100).masked_fill(ids == V.IMAGE, -100)
    one = ids[:1].clone()
    one[0, 17 + INTERNVL_TOKENS :] = torch.randint(3, 140, (37 - 17 - INTERNVL_TOKENS,), generator=gen)
    one[0, 8 : 8 + INTERNVL_TOKENS] = torch.randint(3, 140, (INTERNVL_TOKENS,), generator=gen)
    return {
        "three_images": {"input_ids": ids, "attention_mask": mask, "labels": labels,
                         "pixel_values": torch.randn(3, 3, 8, 8, generator=gen)},
        "one_image": {"input_ids": one, "labels": one.masked_fill(one == V.IMAGE, -100),
                      "pixel_values": torch.randn(1, 3, 8, 8, generator=gen)},
    }  # fmt: skip


def _pixtral_cases() -> dict[str, dict[str, torch.Tensor]]:
    """Two images of different sizes (8 x 8 and 4 x 8 pixels: 16 and 8 tokens, `image_sizes`), the first across
    the SP=2 boundary (27) of a 53-token row, next to a padded text-only row."""
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 140, (2, 53), generator=gen)
    ids[0, 20:36], ids[0, 40:48] = V.IMAGE, V.IMAGE
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100).masked_fill(ids == V.IMAGE, -100)
    pixels = torch.randn(2, 3, 8, 8, generator=gen)
    pixels[1, :, 4:] = 0  # the smaller image, padded as the processor pads it
    return {"two_sizes": {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels,
                          "image_sizes": torch.tensor([[8, 8], [4, 8]])}}  # fmt: skip


def cases(arch: str) -> dict[str, dict[str, torch.Tensor]]:
    """Per arch: rows whose items (frames, images) straddle shards, and fewer items than SP ranks."""
    if arch == "internvl":
        return _internvl_cases()
    if arch == "pixtral":
        return _pixtral_cases()
    return {
        "video_and_image": _video_batch(arch, frames=6, image=True),  # 7 items over the shards of a 61-token row
        "one_image": V.batch([V.row(37, [(20, (4, 4))], seed=6)], 37),  # 1 item: ranks without one
        "two_rows": V.cases(arch)["two_rows"],  # two images next to a text-only row
    }


def tower_calls(batch: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """(pixel rows, items) of each tower call the batch makes, images first: items are frames (Qwen) or images."""
    out = []
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        if pixels in batch:
            items = int(batch[grid][:, 0].sum()) if grid in batch else batch[pixels].shape[0]
            out.append((batch[pixels].shape[0], items))
    return out


def loss_of(model: torch.nn.Module, batch: dict[str, torch.Tensor], groups) -> torch.Tensor:
    """The SP loss of one forward (the plain mean cross-entropy without groups)."""
    if groups is None:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        shift = batch["labels"][:, 1:]
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), shift.flatten(), ignore_index=-100)
    return V.sp_loss(model, batch, groups)


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient (None where it has none); FSDP2's DTensors in full."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def sp_mean_grads(model: torch.nn.Module, groups) -> dict[str, torch.Tensor | None]:
    """Every gradient averaged over the SP group, as the DP engine's all-reduce would."""
    return V.sp_mean(grads_of(model), groups)


def reference(arch: str, batch: dict[str, torch.Tensor], frozen: bool) -> tuple[float, dict]:
    """The plain model on the whole batch, no hf_longctx."""
    model = build(arch)
    if frozen:
        tower(model).requires_grad_(False)
    loss = loss_of(model, batch, None)
    loss.backward()
    return loss.item(), grads_of(model)


def shard_worker(rank: int, world_size: int, runs: list[tuple[str, str, str, bool]]) -> dict:
    """Each `(arch, backend, case, frozen)` at SP=world_size: loss, the SP-summed gradients (the DP engine's
    average), and the pixel rows every rank's tower received."""
    import hf_longctx

    torch.set_num_threads(1)
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    out = {}
    for arch, backend, name, frozen in runs:
        batch = cases(arch)[name]
        model = build(arch)
        if frozen:
            tower(model).requires_grad_(False)
        with hf_longctx.enable_sequence_parallel(model, groups, backend):
            rows, _ = record_tower_rows(model)
            loss = loss_of(model, batch, groups)
            loss.backward()
        grads = sp_mean_grads(model, groups)
        every = [None] * world_size
        dist.all_gather_object(every, rows, group=groups.sp_group)
        out[(arch, backend, name, frozen)] = (loss.item(), grads, every)
    return out


def fsdp2_worker(rank: int, world_size: int, arch: str, name: str) -> tuple[float, dict, list[int]]:
    """`arch` on case `name` under FSDP2, the vision tower and its blocks sharded units of their own, so a rank
    that skipped the tower would leave its parameter all-gathers unmatched (a hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hf_longctx

    torch.set_num_threads(1)
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    model = build(arch)
    hf_longctx.enable_sequence_parallel(model, groups)
    rows, _ = record_tower_rows(model)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in tower(model).blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(tower(model), mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss = loss_of(model, cases(arch)[name], groups)
    loss.backward()
    return loss.item(), grads_of(model), rows


def zero3_worker(rank: int, world_size: int, out_dir: str, arch: str) -> dict:
    """Three SGD steps of the stock Trainer under DeepSpeed ZeRO-3 (every parameter partitioned, the vision
    tower's included) at SP=world_size on `_vlm.RowDataset`: the logged steps, each tower call's whole input
    and the patch rows this rank's tower encoded of it. Batches with one image leave a rank without one: it
    must still join ZeRO-3's gathers."""
    from transformers import Trainer, TrainingArguments

    import hf_longctx
    from tests.dist._trainer_utils import engine_args

    torch.set_num_threads(1)
    model = V.build(arch)  # before the ZeRO-3 arguments: built under zero.Init its random init would differ
    rows = V.count_patch_rows(model)
    calls: list[tuple[int, int]] = []  # (patch rows, images) each tower call gets before SP's hook cuts it
    tower(model).register_forward_pre_hook(lambda _m, a, kw: calls.append((a[0].shape[0], len(kw["grid_thw"]))),
                                           with_kwargs=True)  # fmt: skip
    args = TrainingArguments(
        output_dir=out_dir, report_to=[], disable_tqdm=True, seed=1, per_device_train_batch_size=2, max_steps=3,
        optim="sgd", learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant", logging_steps=1,
        save_strategy="no", remove_unused_columns=False, **engine_args(3),
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=world_size),
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=V.RowDataset(), data_collator=V.collate)
    trainer.train()
    logs = [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]} for h in trainer.state.log_history
            if "loss" in h]  # fmt: skip
    return {"logs": logs, "tower_rows": rows, "calls": calls}


def lone_call_worker(rank: int, world_size: int, arch: str) -> tuple[bool, float, dict]:
    """Under SP, rank 0 alone calls `get_image_features` outside the forward (no collective to wait on: it gets
    the whole input's features, as the plain model's); then every rank trains one sharded forward as usual."""
    import hf_longctx

    torch.set_num_threads(1)
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    batch = cases(arch)["video_and_image"]
    model = build(arch)
    with torch.no_grad():
        plain = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    with hf_longctx.enable_sequence_parallel(model, groups):
        same = True
        if rank == 0:
            with torch.no_grad():
                alone = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
            same = all(torch.equal(a, b) for a, b in zip(_flat(alone), _flat(plain), strict=True))
        loss = loss_of(model, batch, groups)
        loss.backward()
    grads = sp_mean_grads(model, groups)
    return same, loss.item(), grads


def _flat(output) -> list[torch.Tensor]:
    """The tensors of a (nested) model output, in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for v in values for t in _flat(v)]

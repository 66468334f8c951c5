"""TRL `SFTTrainer` on a vision dataset with a tiny Qwen2.5-VL / Qwen3-VL: an offline processor and images made here.

The processor is the model's own (Qwen2.5-VL's or Qwen3-VL's) over a word-level tokenizer whose special tokens carry
the ids of `_vlm` and the PIL image processor sized to the tiny vision tower (patch 2, merge 2, temporal patch 1).
It is built for images only: the video processor needs torchvision, which this project does not depend on.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.dist import _vlm as V

_SPECIAL = {"<pad>": 0, "<s>": 1, "</s>": 2, "<|image_pad|>": V.IMAGE, "<|video_pad|>": V.VIDEO,
            "<|vision_start|>": V.START, "<|vision_end|>": V.END}  # fmt: skip


def processor(arch: str):
    """The `arch` processor (images only) whose tokens match `_vlm`'s vocabulary, built without the Hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    words = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(3, 140)}, **_SPECIAL}, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"},
    )  # fmt: skip
    tokenizer.add_special_tokens({"additional_special_tokens": list(_SPECIAL)[3:]})

    base = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[arch]

    class ImageProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    images = Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=1, merge_size=2, min_pixels=16, max_pixels=4096)
    return ImageProcessor(images, tokenizer)


def _image(height: int, width: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def dataset():
    """Eight text rows with 0-2 images (each 8x8 or 8x12 pixels: 4 or 6 image tokens) at varied offsets."""
    from datasets import Dataset

    rows = []
    for i in range(8):
        gen = np.random.RandomState(100 + i)
        words = [f"w{w}" for w in gen.randint(3, 140, 30 - 3 * (i % 3))]
        sizes = [(8, 8), (8, 12)][: i % 3]
        images = [_image(h, w, seed=10 * i + j) for j, (h, w) in enumerate(sizes)]
        for j in range(len(images)):
            words.insert(4 + 11 * j + i, "<|vision_start|><|image_pad|><|vision_end|>")
        rows.append({"text": " ".join(words), "images": images})
    return Dataset.from_list(rows)


def sft_worker(rank: int, world_size: int, out_dir: str, arch: str) -> dict:
    """Three SGD steps of TRL's SFTTrainer (batch 2, fp32: SFTConfig's default is bf16) at SP=world_size:
    the logged steps and the first step's gradients (after DDP)."""
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    parallelism = None
    if world_size > 1:
        import hf_longctx

        parallelism = hf_longctx.ParallelismConfig(sp_size=world_size)
    args = SFTConfig(
        output_dir=out_dir, use_cpu=True, report_to=[], disable_tqdm=True, seed=1, per_device_train_batch_size=2,
        max_steps=3, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="no", remove_unused_columns=False, max_length=None,
        bf16=False, parallelism_config=parallelism,
    )  # fmt: skip
    model = V.build(arch)
    rows = V.count_patch_rows(model)
    first: dict[str, torch.Tensor] = {}

    class FirstGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if not first:
                first.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=processor(arch),
                         callbacks=[FirstGradients()])  # fmt: skip
    trainer.train()
    logs = [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]} for h in trainer.state.log_history
            if "loss" in h]  # fmt: skip
    return {"logs": logs, "attn": model.config.get_text_config()._attn_implementation, "first_grads": first,
            "tower_rows": sum(rows)}  # fmt: skip

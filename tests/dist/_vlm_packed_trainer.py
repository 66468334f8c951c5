"""Trainer workers for packed VLM rows: three SGD steps (batch 2, no clipping) and the first step's gradients.

- `trainer_worker`: the stock Trainer over documents with images, collated padding-free the way TRL's
  `DataCollatorForLanguageModeling(padding_free=True)` does it (one row, `position_ids` restarting per document,
  no `attention_mask`, the first label of each document -100). TRL 1.16 itself refuses packing and padding_free
  for vision datasets, so this collator stands in for it.
- `sft_media_worker`: TRL's SFTTrainer on such rows with videos too, given processed (`skip_prepare_dataset`)
  with a packing collator: the route TRL 1.16 leaves for packed image rows.
- `sft_worker`: TRL's SFTTrainer on a Qwen VLM and its processor with a text-only dataset and
  `SFTConfig(packing=True)` (BFD packing, padding-free), which TRL 1.16 does accept for a VLM.

`doc_exact` (one process) trains with `ParallelismConfig(sp_size=1)`: hf_longctx serves the VLM at SP=1,
documents apart, each with its own positions (`hf_longctx/multimodal/mrope.py`). transformers' own run of a
packed row is no reference: it computes mRoPE positions per row, and lets packed documents attend to each other
under its training defaults.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.dist import _vlm as V
from tests.dist import _vlm_packed as P
from tests.dist import _vlm_sft as S

DOCS: list[P.Doc] = [
    (14, [(3, (4, 4))], 31), (9, [], 32), (21, [(2, (4, 6)), (12, (4, 4))], 33),
    (17, [(9, (4, 4))], 34), (11, [], 35), (19, [(3, (6, 4))], 36),
]  # fmt: skip


class Documents(torch.utils.data.Dataset):
    """`DOCS`, one document per example."""

    def __len__(self) -> int:
        return len(DOCS)

    def __getitem__(self, i: int) -> dict:
        return {"doc": DOCS[i]}


def padding_free(features: list[dict]) -> dict[str, torch.Tensor]:
    """The examples flattened into one padding-free row (`_vlm_packed.pack`)."""
    return P.pack([[f["doc"] for f in features]])


def _train(trainer_cls: type, model: torch.nn.Module, args: Any, **kwargs: Any) -> dict:
    """Train; the logged steps, the first step's gradients and the documents of each padding-free batch."""
    from transformers import TrainerCallback

    first: dict[str, torch.Tensor] = {}

    class FirstGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if not first:  # after DDP's reduction: what the optimizer applies
                first.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer = trainer_cls(model=model, args=args, callbacks=[FirstGradients()], **kwargs)
    collate, documents = trainer.data_collator, []

    def counting(features: list[dict]) -> dict:
        batch = collate(features)
        documents.append(int((batch["position_ids"] == 0).sum()) if "attention_mask" not in batch else 0)
        return batch

    trainer.data_collator = counting
    trainer.train()
    logs = [{"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]} for h in trainer.state.log_history
            if "loss" in h]  # fmt: skip
    attn = model.config.get_text_config()._attn_implementation
    return {"logs": logs, "attn": attn, "first_grads": first, "documents": documents}


def _model(arch: str, world_size: int, doc_exact: bool) -> tuple[torch.nn.Module, Any]:
    import hf_longctx

    # The reference (doc_exact) is the Trainer at sp_size=1 through hf_longctx: it serves VLMs there too, with
    # per-document mRoPE positions, so packed rows train the same at every SP size.
    return V.build(arch), hf_longctx.ParallelismConfig(sp_size=world_size) if doc_exact or world_size > 1 else None


_ARGS = {"use_cpu": True, "report_to": [], "disable_tqdm": True, "seed": 1, "per_device_train_batch_size": 2,
         "max_steps": 3, "optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 0.0, "lr_scheduler_type": "constant",
         "logging_steps": 1, "save_strategy": "no"}  # fmt: skip


def trainer_worker(rank: int, world_size: int, out_dir: str, arch: str, doc_exact: bool) -> dict:
    """The stock Trainer on padding-free rows of `DOCS` at SP=world_size."""
    from transformers import Trainer, TrainingArguments

    torch.set_num_threads(1)
    model, parallelism = _model(arch, world_size, doc_exact)
    args = TrainingArguments(output_dir=out_dir, remove_unused_columns=False, parallelism_config=parallelism, **_ARGS)
    return _train(Trainer, model, args, train_dataset=Documents(), data_collator=padding_free)


def _text_dataset():
    from datasets import Dataset

    gen = torch.Generator().manual_seed(7)
    lengths = [int(n) for n in torch.randint(9, 30, (16,), generator=gen)]
    return Dataset.from_list([{"text": " ".join(f"w{int(w)}" for w in torch.randint(3, 140, (n,), generator=gen))}
                              for n in lengths])  # fmt: skip


def sft_worker(rank: int, world_size: int, out_dir: str, arch: str, doc_exact: bool) -> dict:
    """TRL's SFTTrainer with `packing=True` (BFD, padding-free) on text documents at SP=world_size."""
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    model, parallelism = _model(arch, world_size, doc_exact)
    args = SFTConfig(output_dir=out_dir, packing=True, max_length=64, bf16=False, parallelism_config=parallelism,
                     **_ARGS)  # fmt: skip
    return _train(SFTTrainer, model, args, train_dataset=_text_dataset(), processing_class=S.processor(arch))


def _media_documents(arch: str) -> list[dict[str, torch.Tensor]]:
    """The SFT examples: `DOCS` with a 2-frame and a 3-frame video in their place at 1 and 4 (3 steps of 2)."""
    docs = [P.document(doc) for doc in DOCS]
    docs[1], docs[4] = P.video_document(arch, 2, 43, 0.5), P.video_document(arch, 3, 44, 2.0)
    return docs


def sft_media_worker(rank: int, world_size: int, out_dir: str, arch: str, backend: str, frozen: bool) -> dict:
    """TRL's SFTTrainer on padding-free rows of images, videos and text at SP=world_size (sp_size 1 included:
    hf_longctx keeps the documents apart there too): the route TRL 1.16 leaves for packed image rows, a dataset
    already processed (`skip_prepare_dataset`) and a packing collator. `frozen`: the vision tower does not train."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    import hf_longctx

    torch.set_num_threads(1)
    model = V.build(arch)
    if frozen:
        model.model.visual.requires_grad_(False)
    parallelism = hf_longctx.ParallelismConfig(sp_size=world_size, sp_backend=backend)
    args = SFTConfig(output_dir=out_dir, bf16=False, parallelism_config=parallelism, remove_unused_columns=False,
                     dataset_kwargs={"skip_prepare_dataset": True}, **_ARGS)  # fmt: skip
    docs = _media_documents(arch)

    def collate(features: list[dict]) -> dict[str, torch.Tensor]:
        return P.flatten([docs[f["index"]] for f in features])

    # TRL wants a `datasets.Dataset`: the examples are indices into `docs`.
    indices = Dataset.from_list([{"index": i} for i in range(len(docs))])
    return _train(SFTTrainer, model, args, train_dataset=indices, data_collator=collate,
                  processing_class=S.processor(arch))  # fmt: skip

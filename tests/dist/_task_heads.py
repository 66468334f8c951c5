"""Models and batches of `test_heads_adapters.py`: token-classification and extractive-QA heads, and causal LMs with
PEFT adapters that add to the loss (AdaLoRA) or attend to a prompt of their own (LLaMA-Adapter).

Built the same in every process (seeded), dropout off so SP and the run without it see the same network.
"""

from __future__ import annotations

import torch

from tests._models import tiny_config

IGNORE = -100
NUM_TAGS = 5
SEQ_LEN = 37  # odd: SP pads it


def task_model(arch: str, head: str, seed: int = 0) -> torch.nn.Module:
    """A tiny `<Arch>ForTokenClassification` ("token") or `<Arch>ForQuestionAnswering` ("qa"), float32, train mode."""
    from transformers import AutoModelForQuestionAnswering, AutoModelForTokenClassification

    config = tiny_config(arch)
    config.num_labels = NUM_TAGS
    config.classifier_dropout = 0.0
    torch.manual_seed(seed)
    auto = AutoModelForTokenClassification if head == "token" else AutoModelForQuestionAnswering
    model = auto.from_config(config).float()
    model.train()
    return model


def adapter_model(kind: str, head: str = "causal") -> torch.nn.Module:
    """A tiny Llama with an AdaLoRA ("adalora", orthogonal regulariser weight 0.5) or LLaMA-Adapter ("adaption")
    adapter, its trainable weights perturbed so the regulariser and the prompt gate are not at their zero init.
    `head`: "causal" (a causal LM), "token" or "qa" (AdaLoRA on a token-classification or QA head)."""
    from peft import AdaLoraConfig, AdaptionPromptConfig, get_peft_model

    from tests._models import tiny_model

    base = tiny_model("llama") if head == "causal" else task_model("llama", head)
    if kind == "adalora":
        task = {"causal": "CAUSAL_LM", "token": "TOKEN_CLS", "qa": "QUESTION_ANS"}[head]
        config = AdaLoraConfig(
            r=4, init_r=4, target_r=2, target_modules=["q_proj", "v_proj"], total_step=10, orth_reg_weight=0.5,
            task_type=task,
        )  # fmt: skip
    else:
        config = AdaptionPromptConfig(adapter_len=4, adapter_layers=2, task_type="CAUSAL_LM")
    torch.manual_seed(1)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    model.train()
    return model


def causal_batches() -> list[dict[str, torch.Tensor]]:
    """Next-token batches: two rows of 37 tokens (the second right-padded after 29), then a packed row."""
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(1, 128, (2, SEQ_LEN), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 29:] = 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    packed = torch.randint(1, 128, (1, SEQ_LEN), generator=g)
    positions = torch.cat([torch.arange(20), torch.arange(17)]).unsqueeze(0)
    packed_labels = packed.clone()
    packed_labels[0, 20] = IGNORE  # no loss across the boundary (as DataCollatorWithFlattening marks it)
    return [
        {"input_ids": ids, "labels": labels, "attention_mask": mask},
        {"input_ids": packed, "labels": packed_labels, "position_ids": positions},
    ]


def token_batches() -> list[dict[str, torch.Tensor]]:
    """Two batches of per-token tags: rows of 37 tokens, the second right-padded after 29, scattered untagged
    tokens; then one packed row of documents of 20 and 17 tokens."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 128, (2, SEQ_LEN), generator=g)
    tags = torch.randint(0, NUM_TAGS, (2, SEQ_LEN), generator=g)
    tags[torch.rand(2, SEQ_LEN, generator=g) < 0.2] = IGNORE
    mask = torch.ones_like(ids)
    mask[1, 29:], tags[1, 29:] = 0, IGNORE
    packed_ids = torch.randint(1, 128, (1, SEQ_LEN), generator=g)
    packed = {
        "input_ids": packed_ids,
        "labels": torch.randint(0, NUM_TAGS, (1, SEQ_LEN), generator=g),
        "position_ids": torch.cat([torch.arange(20), torch.arange(17)]).unsqueeze(0),
    }
    return [{"input_ids": ids, "labels": tags, "attention_mask": mask}, packed]


def qa_batches() -> list[dict[str, torch.Tensor]]:
    """Four rows of 37 tokens (the last right-padded after 25): answers on either side of every shard boundary
    at SP=2 and 4, one starting at 0, one clamped from a negative index, one ignored (at the row's length), and an
    end past the row (ignored); then two rows without SP padding or mask, one start past the row (ignored)."""
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(1, 128, (4, SEQ_LEN), generator=g)
    mask = torch.ones_like(ids)
    mask[3, 25:] = 0
    first = {
        "input_ids": ids,
        "attention_mask": mask,
        "start_positions": torch.tensor([3, 19, -2, SEQ_LEN]),
        "end_positions": torch.tensor([9, 30, 0, SEQ_LEN + 4]),
    }
    second = {
        "input_ids": ids[:2],
        "start_positions": torch.tensor([SEQ_LEN + 1, 5]),
        "end_positions": torch.tensor([36, 10]),
    }
    return [first, second]


def _rows(head: str, n: int) -> list[dict]:
    """`n` rows: 24..33 tokens with 20 tagged tokens each ("token"), or 31 tokens with an answer inside ("qa": the
    positions of a row's padding take part in transformers' softmax, so rows of one length let a batch of two rows
    under SP and one row per DDP rank compute the same losses)."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(n):
        length = int(torch.randint(24, 34, (1,), generator=g)) if head == "token" else 31
        row = {"input_ids": torch.randint(1, 128, (length,), generator=g).tolist()}
        if head == "token":
            tags = torch.randint(0, NUM_TAGS, (length,), generator=g)
            tags[torch.randperm(length, generator=g)[: length - 20]] = IGNORE
            row["labels"] = tags.tolist()
        else:
            start = int(torch.randint(0, length, (1,), generator=g))
            row["start_positions"] = start
            row["end_positions"] = int(torch.randint(start, length, (1,), generator=g))
        rows.append(row)
    return rows


def _collate(features: list[dict]) -> dict[str, torch.Tensor]:
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for i, f in enumerate(features):
        n = len(f["input_ids"])
        ids[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), 1
        if "labels" in f:
            labels[i, :n] = torch.tensor(f["labels"])
    batch = {"input_ids": ids, "attention_mask": mask}
    if "labels" in features[0]:
        batch["labels"] = labels
    else:
        for key in ("start_positions", "end_positions"):
            batch[key] = torch.tensor([f[key] for f in features])
    return batch


def trainer_worker(rank: int, world_size: int, out_dir: str) -> dict:
    """Per head, 3 SGD steps of the stock Trainer and one evaluation twice: SP over the `world_size` ranks (a
    per-device batch of `world_size` rows) and plain DDP over them (1 row each): the same rows per step."""
    return {sp: _train(out_dir, sp, world_size) for sp in (world_size, 1)}


def _train(out_dir: str, sp: int, world_size: int) -> dict:
    import os

    import datasets
    from transformers import Trainer, TrainingArguments

    import hf_longctx

    results = {}
    for head in ("token", "qa"):
        batch = world_size if sp > 1 else 1
        args = TrainingArguments(
            output_dir=os.path.join(out_dir, f"{head}_sp{sp}"),
            use_cpu=True,
            optim="sgd",
            learning_rate=0.1,
            max_grad_norm=0.0,  # no clipping; grad_norm is still logged
            lr_scheduler_type="constant",
            max_steps=3,
            per_device_train_batch_size=batch,
            per_device_eval_batch_size=batch,
            logging_steps=1,
            report_to=[],
            disable_tqdm=True,
            save_strategy="no",
            remove_unused_columns=False,
            parallelism_config=hf_longctx.ParallelismConfig(sp_size=sp) if sp > 1 else None,
        )
        trainer = Trainer(
            model=task_model("llama", head),
            args=args,
            train_dataset=datasets.Dataset.from_list(_rows(head, 12)),
            eval_dataset=datasets.Dataset.from_list(_rows(head, 4)),
            data_collator=_collate,
        )
        trainer.train()
        logs = [{k: h[k] for k in ("step", "loss", "grad_norm")} for h in trainer.state.log_history if "loss" in h]
        attn = trainer.model.config._attn_implementation  # hf_longctx's key under SP, the model's own without
        results[head] = {"logs": logs, "eval_loss": trainer.evaluate()["eval_loss"], "attn": attn}
        hf_longctx.integrations.trainer.detach(trainer)
    return results

"""Worker functions for the TRL / PEFT SP tests (spawned by `tests._dist.run_distributed`)."""

from __future__ import annotations

import os
from typing import Any

import torch

import hf_longctx
from tests._models import tiny_model
from tests.dist import _trainer_utils as U


def preference_rows(n: int, seed: int = 7) -> list[dict[str, str]]:
    """Text preference rows for the WordLevel tokenizer ("t5 t17 ..."): a prompt, and chosen / rejected
    completions of different lengths."""
    gen = torch.Generator().manual_seed(seed)

    def text(lo: int, hi: int) -> str:
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return " ".join(f"t{i}" for i in torch.randint(3, U.VOCAB, (length,), generator=gen).tolist())

    return [{"prompt": text(5, 11), "chosen": " " + text(3, 9), "rejected": " " + text(2, 12)} for _ in range(n)]


def refused_trainer_errors(out_dir: str) -> dict[str, str | None]:
    """`NotImplementedError` message (None: constructed fine) of each TRL trainer built with SP=2."""
    import datasets
    from transformers import AutoModelForSequenceClassification, LlamaConfig
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, RewardConfig, RewardTrainer

    common = {"use_cpu": True, "report_to": [], "max_steps": 1, "bf16": False}
    pc = hf_longctx.ParallelismConfig(sp_size=2)
    rows = preference_rows(4)
    pairs = datasets.Dataset.from_list(rows)
    unpaired = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "completion": r["chosen"], "label": i % 2 == 0} for i, r in enumerate(rows)]
    )

    def reward_model():
        config = tiny_model("llama").config
        config = LlamaConfig(**{**config.to_dict(), "num_labels": 1, "pad_token_id": 0})
        torch.manual_seed(0)
        return AutoModelForSequenceClassification.from_config(config)

    builders = {
        "DPOTrainer": lambda d: DPOTrainer(
            model=tiny_model("llama"),
            args=DPOConfig(d, parallelism_config=pc, **common),
            train_dataset=pairs,
            processing_class=U.tiny_tokenizer(),
        ),
        "KTOTrainer": lambda d: KTOTrainer(
            model=tiny_model("llama"),
            args=KTOConfig(d, parallelism_config=pc, **common),
            train_dataset=unpaired,
            processing_class=U.tiny_tokenizer(),
        ),
        "RewardTrainer": lambda d: RewardTrainer(
            model=reward_model(),
            args=RewardConfig(d, parallelism_config=pc, **common),
            train_dataset=pairs,
            processing_class=U.tiny_tokenizer(),
        ),
    }
    messages: dict[str, str | None] = {}
    for name, build in builders.items():
        try:
            build(os.path.join(out_dir, name))
        except NotImplementedError as exc:
            messages[name] = str(exc)
        else:
            messages[name] = None
    return messages


def refusal_worker(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    return refused_trainer_errors(out_dir)

"""Worker functions for the TRL / PEFT SP tests (spawned by `tests._dist.run_distributed`)."""

from __future__ import annotations

import os
from typing import Any

import torch

import hf_longctx
from tests._models import tiny_model
from tests.dist import _sft_utils as SU
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
    import warnings

    import datasets

    with warnings.catch_warnings():  # TRL warns that trl.experimental may change
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOConfig, CPOTrainer

    common = {"use_cpu": True, "report_to": [], "max_steps": 1, "bf16": False}
    pc = hf_longctx.ParallelismConfig(sp_size=2)
    paired = datasets.Dataset.from_list(preference_rows(4))

    builders = {
        "CPOTrainer": lambda d: CPOTrainer(
            model=tiny_model("llama"),
            args=CPOConfig(d, parallelism_config=pc, **common),
            train_dataset=paired,
            processing_class=SU.tiny_tokenizer(),
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


# ---- PEFT (LoRA) runs ----------------------------------------------------------------------------

LORA_KEYS = ("loss", "grad_norm")


def lora_config():
    """LoRA on every linear layer, A and B random (not B = 0) so both get gradients; seeds the init."""
    from peft import LoraConfig

    torch.manual_seed(2)
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)


def lora_model(shape: dict[str, int] | None = None):
    """The tiny llama (`shape`: `tiny_model` head/width arguments) with `lora_config()` adapters."""
    from peft import get_peft_model

    model = tiny_model("llama", **(shape or {}))
    return get_peft_model(model, lora_config())


def _zero3_args(stage: int | None) -> dict[str, Any]:
    """TrainingArguments for DeepSpeed ZeRO on CPU (see test_deepspeed.py: a gloo state must exist first)."""
    if stage is None:
        return {"use_cpu": True}
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    # An earlier run in this process configured the shared state without DeepSpeed: start it again.
    AcceleratorState._reset_state(reset_partial_state=True)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    config = {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    return {"use_cpu": False, "deepspeed": config, "accelerator_config": {"use_configured_state": True}}


def run_lora(
    out_dir: str,
    *,
    sp: int = 1,
    trainer: str = "trainer",
    peft_config: bool = False,
    steps: int = 4,
    gradient_checkpointing: bool = False,
    zero: int | None = None,
    save_steps: int | None = None,
    resume_from: str | None = None,
    sp_options: dict | None = None,
    flags: dict[str, Any] | None = None,
    shape: dict[str, int] | None = None,
    batch: int = U.BATCH,
) -> dict[str, Any]:
    """Train LoRA adapters on the tiny llama (SGD, no clipping) in this process; return the per-step logs and the
    trained adapter weights.

    trainer: "trainer" (stock Trainer on `get_peft_model(model, ...)`) or "sft" (`SFTTrainer`, given the PEFT model,
    or with `peft_config=True` the plain model and `peft_config=LoraConfig(...)`). `shape`: the model's
    heads and width (`tiny_model` arguments), e.g. 9 query / 3 KV heads. `batch`: rows per device and step.
    """
    from transformers import Trainer, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    common = {
        "output_dir": out_dir,
        "report_to": [],
        "disable_tqdm": True,
        "seed": 1,
        "per_device_train_batch_size": batch,
        "max_steps": steps,
        "optim": "sgd",
        "learning_rate": U.LR["sgd"],
        "max_grad_norm": 0.0,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "steps" if save_steps else "no",
        "save_steps": save_steps or 500,
        "gradient_checkpointing": gradient_checkpointing,
        "parallelism_config": U.parallelism_config(sp, sp_options, flags),
        **_zero3_args(zero),
    }
    if trainer == "trainer":
        model = lora_model(shape)
        args = TrainingArguments(remove_unused_columns=False, **common)
        run = Trainer(model=model, args=args, train_dataset=U.dataset("mixed", 24), data_collator=U.RecordingCollator())
    else:
        args = SFTConfig(bf16=False, max_length=64, **common)
        extra: dict[str, Any] = {"model": lora_model(shape)}
        if peft_config:
            extra = {"model": tiny_model("llama", **(shape or {})), "peft_config": lora_config()}
        run = SFTTrainer(
            args=args, train_dataset=SU.sft_dataset("completion", 16), processing_class=SU.tiny_tokenizer(), **extra
        )
    run.train(resume_from_checkpoint=resume_from)
    model = run.accelerator.unwrap_model(run.model)
    weights = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            weights[name] = param.detach().float().clone()
            if zero == 3:
                import deepspeed

                with deepspeed.zero.GatheredParameters([param]):
                    weights[name] = param.detach().float().clone()
    return {
        "logs": U.logged_steps(run, LORA_KEYS),
        "trainable": sorted(weights),
        "weights": weights,
        "attn": model.config._attn_implementation,
        "peft": type(model).__name__,
        "memory": U.memory_flags_active(model.get_base_model()),
    }


def lora_worker(rank: int, world_size: int, out_dir: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run every named `run_lora` configuration in order (each in `out_dir/name`); `resume_from` names an earlier
    configuration's checkpoint subdirectory."""
    results = {}
    for name, config in configs.items():
        config = dict(config)
        if config.get("resume_from"):
            config["resume_from"] = os.path.join(out_dir, config["resume_from"])
        results[name] = run_lora(os.path.join(out_dir, name), **config)
    return results


# ---- RewardTrainer runs --------------------------------------------------------------------------

REWARD_KEYS = ("loss", "grad_norm", "accuracy", "margin", "mean_reward", "min_reward", "max_reward", "num_tokens")


def reward_rows(n: int, seed: int = 9) -> list[dict[str, str]]:
    """Text pairs whose chosen is long (20..30 tokens) and rejected short (2..7): in every padded batch the
    chosen rows end on SP rank 1 and the rejected rows on rank 0."""
    gen = torch.Generator().manual_seed(seed)

    def text(lo: int, hi: int) -> str:
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return " ".join(f"t{i}" for i in torch.randint(3, U.VOCAB, (length,), generator=gen).tolist())

    return [{"chosen": text(20, 30), "rejected": text(2, 7)} for _ in range(n)]


def reward_model(peft: bool = False):
    """The tiny llama as a 1-label sequence classifier (pad id 0), seeded; optionally with LoRA."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    config = LlamaConfig(**{**tiny_model("llama").config.to_dict(), "num_labels": 1, "pad_token_id": 0})
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    if peft:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)
        lora = LoraConfig(
            r=4, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False, task_type="SEQ_CLS"
        )
        model = get_peft_model(model, lora)
    return model


def run_reward(
    out_dir: str,
    *,
    sp: int = 1,
    steps: int = 4,
    sp_options: dict | None = None,
    peft: bool = False,
    eval_rows: int | None = None,
):
    """Train the tiny reward model with TRL's RewardTrainer (SGD, no clipping); logs and trained weights, and
    with `eval_rows` the metrics of `trainer.evaluate()` on that many held-out pairs afterwards."""
    import datasets
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(
        out_dir,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=1,
        bf16=False,
        per_device_train_batch_size=U.BATCH,
        per_device_eval_batch_size=U.BATCH,
        max_steps=steps,
        optim="sgd",
        learning_rate=U.LR["sgd"],
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        parallelism_config=U.parallelism_config(sp, sp_options),
    )
    trainer = RewardTrainer(
        model=reward_model(peft),
        args=args,
        train_dataset=datasets.Dataset.from_list(reward_rows(16)),
        processing_class=SU.tiny_tokenizer(),
    )
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    attn = model.config._attn_implementation
    result = {"logs": U.logged_steps(trainer, REWARD_KEYS), "weights": weights, "attn": attn}
    if eval_rows:
        metrics = trainer.evaluate(datasets.Dataset.from_list(reward_rows(eval_rows, seed=13)))
        result["eval"] = {k.removeprefix("eval_"): v for k, v in metrics.items() if k.startswith("eval_")}
    return result


def reward_worker(rank: int, world_size: int, out_dir: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run every named `run_reward` configuration in order (each in `out_dir/name`)."""
    return {name: run_reward(os.path.join(out_dir, name), **config) for name, config in configs.items()}

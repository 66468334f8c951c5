"""Worker functions for the DPOTrainer SP tests (spawned by `tests._dist.run_distributed`)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

import hf_longctx
from tests._models import tiny_model
from tests.dist import _sft_utils as SU
from tests.dist import _trainer_utils as U

DPO_KEYS = (
    "loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "entropy",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "num_tokens",
    "aux_loss",  # logged only with the MoE router loss on
)
BETA = 0.5
PATCHED = ("_compute_loss", "compute_ref_log_probs")  # the DPOTrainer methods hf_longctx replaces on the instance
LR = 0.005  # DPO gradients are large (norm ~5-30): a small step keeps the runs from amplifying rounding
# Every TRL 1.16 loss type but sigmoid (the default, in the other runs), weighted.
MIXED_LOSSES = {
    "hinge": 1.0,
    "ipo": 0.5,
    "sigmoid_norm": 0.7,
    "robust": 0.3,
    "exo_pair": 0.4,
    "nca_pair": 0.6,
    "bco_pair": 0.2,
    "sppo_hard": 0.05,
    "aot": 0.8,
    "aot_unpaired": 0.9,
    "apo_zero": 1.1,
    "apo_down": 1.2,
    "discopop": 0.35,
    "sft": 0.1,
}


def dpo_rows(n: int, seed: int = 11) -> list[dict[str, str]]:
    """Preference rows for the WordLevel tokenizer: a prompt of 6..14 tokens and chosen / rejected completions
    of 3..16 tokens, drawn independently (their lengths differ in most pairs)."""
    gen = torch.Generator().manual_seed(seed)

    def text(lo: int, hi: int) -> str:
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return " ".join(f"t{i}" for i in torch.randint(3, U.VOCAB, (length,), generator=gen).tolist())

    return [{"prompt": text(6, 14), "chosen": " " + text(3, 16), "rejected": " " + text(3, 16)} for _ in range(n)]


def _dataset(out_dir: str, name: str, rows: list[dict[str, str]]):
    """A file-backed dataset: TRL's precomputed reference log-probs are cached next to its files, which every
    rank must read (an in-memory dataset caches in a per-process temporary directory)."""
    import datasets

    path = os.path.join(out_dir, f"{name}.json")
    if not os.path.exists(path):
        os.makedirs(out_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, path)
    return datasets.load_dataset("json", data_files=path, split="train", cache_dir=os.path.join(out_dir, "cache"))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)


def dpo_config(
    out_dir: str, *, sp: int = 1, steps: int = 4, sp_options: dict | None = None, zero: int | None = None, **extra: Any
):
    from trl import DPOConfig

    from tests.dist._trl_jobs import _zero3_args

    fields = {
        "report_to": [],
        "disable_tqdm": True,
        "seed": 1,
        "bf16": False,
        "per_device_train_batch_size": U.BATCH,
        "per_device_eval_batch_size": U.BATCH,
        "max_steps": steps,
        "optim": "sgd",
        "learning_rate": LR,
        "max_grad_norm": 0.0,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "beta": BETA,
        "parallelism_config": U.parallelism_config(sp, sp_options),
        **_zero3_args(zero),
    }
    return DPOConfig(out_dir, **{**fields, **extra})


def run_dpo(
    out_dir: str,
    *,
    sp: int = 1,
    reference: str = "model",
    evaluate: bool = False,
    sp_options: dict | None = None,
    shape: dict[str, int] | None = None,
    arch: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Train the tiny llama with TRL's DPOTrainer (SGD, no clipping); per-step logs, eval metrics, trained weights.

    reference: "model" (a separate reference model, other weights), "peft" (LoRA via `peft_config`: the
    reference is the policy with its adapter disabled, no copy) or "precompute" (LoRA, reference log-probs
    precomputed by TRL before training). shape: `tiny_model` head/hidden sizes for both models. arch: another tiny
    model for both (`tests._sequence_models.sequence_model`, e.g. "moe:qwen3_moe" with its router loss on).
    """
    from trl import DPOTrainer

    from tests._sequence_models import sequence_model

    data_dir = os.path.dirname(out_dir)
    shape = shape or {}

    def build(seed: int) -> torch.nn.Module:
        return sequence_model(arch, seed=seed) if arch else tiny_model("llama", seed=seed, **shape)

    kwargs: dict[str, Any] = {"model": build(0)}
    if reference == "model":
        kwargs["ref_model"] = build(1)
    else:
        kwargs["peft_config"] = _lora()
    args = dpo_config(
        out_dir, sp=sp, sp_options=sp_options, precompute_ref_log_probs=reference == "precompute", **extra
    )
    trainer = DPOTrainer(
        args=args,
        train_dataset=_dataset(data_dir, "train", dpo_rows(16)),
        eval_dataset=_dataset(data_dir, "eval", dpo_rows(6, seed=12)) if evaluate else None,
        processing_class=SU.tiny_tokenizer(),
        **kwargs,
    )
    lengths: list[int] = []
    collate = trainer.data_collator

    def recording(features: list[Any]) -> dict[str, Any]:
        batch = collate(features)
        lengths.append(int(batch["input_ids"].shape[1]))  # the full batch, before any SP sharding
        return batch

    trainer.data_collator = recording
    trainer.train()
    evaluated = trainer.evaluate() if evaluate else {}
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            with _gathered(param, extra.get("zero")):
                weights[name] = param.detach().clone()
    attn = model.config._attn_implementation
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    flags = U.memory_flags_active(base)
    logs = U.logged_steps(trainer, DPO_KEYS)
    patched = sorted(name for name in PATCHED if name in vars(trainer))
    hf_longctx.integrations.trainer.detach(trainer)
    undone = {
        "patched": patched,
        "left": sorted(name for name in PATCHED if name in vars(trainer)),
        "collator": type(trainer.data_collator).__name__,
    }
    return {
        "logs": logs,
        "eval": evaluated,
        "weights": weights,
        "attn": attn,
        "lengths": lengths,
        "flags": flags,
        "undone": undone,
    }


def _gathered(param: torch.nn.Parameter, zero: int | None):
    """The full parameter inside the block (ZeRO-3 partitions it)."""
    import contextlib

    if zero != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param])


def refused_option_error(out_dir: str, **options: Any) -> str | None:
    """The `NotImplementedError` message of a DPOTrainer built under SP=2 with `options` (None: it was built)."""
    from trl import DPOTrainer

    try:
        DPOTrainer(
            model=tiny_model("llama"),
            ref_model=tiny_model("llama", seed=1),
            args=dpo_config(out_dir, sp=2, steps=1, **options),
            train_dataset=_dataset(os.path.dirname(out_dir), "train", dpo_rows(16)),
            processing_class=SU.tiny_tokenizer(),
        )
    except NotImplementedError as exc:
        return str(exc)
    return None


def dpo_worker(rank: int, world_size: int, out_dir: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run every named `run_dpo` configuration in order (each in `out_dir/name`; a ZeRO configuration must come
    last: it leaves accelerate's state configured for DeepSpeed); under SP first build one DPOTrainer with a
    refused option (`refused`)."""
    results: dict[str, Any] = {}
    if world_size > 1:
        results["refused"] = refused_option_error(os.path.join(out_dir, "refused"), ld_alpha=0.5)
    for name, config in configs.items():
        results[name] = run_dpo(os.path.join(out_dir, name), **config)
    return results

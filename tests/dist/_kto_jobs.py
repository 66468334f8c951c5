"""Worker functions for the KTOTrainer SP tests (spawned by `tests._dist.run_distributed`).

One spawn runs several named `run_kto` configurations in a row; each returns the per-step logs, every trainable
parameter's gradient at every optimizer step (not under ZeRO-3, which partitions them), the trained weights
under ZeRO-3, the evaluation metrics and, per full batch (before SP sharding), each row's completion span.
"""

from __future__ import annotations

import os
from typing import Any

import torch

import hf_longctx
from tests._models import tiny_model
from tests.dist import _dpo_jobs as DJ
from tests.dist import _sft_utils as SU
from tests.dist import _trainer_utils as U

BETA = 0.5
LR = 0.01
PATCHED = ("_compute_loss", "compute_ref_log_probs")  # the KTOTrainer methods hf_longctx replaces on the instance
# Desirable / undesirable labels: the second batch of two is all desirable, the fourth all undesirable (a micro-batch
# without one side logs no rewards / logps / logits for it, and no margin).
LABELS = (True, False, True, True, False, True, False, False)
# Trainer bookkeeping: compared, but not reported among the metrics' differences.
NOT_METRICS = ("step", "epoch", "learning_rate")


def kto_rows(n: int, seed: int = 21) -> list[dict[str, Any]]:
    """Unpaired rows for the WordLevel tokenizer: even rows long (prompt 8..14 tokens, completion 8..16: in a padded
    batch the completion straddles the middle), odd rows short (prompt 2..3, completion 1..3: the whole row lies in
    the first quarter of its batch, i.e. on SP rank 0 only, at SP=2 and SP=4)."""
    gen = torch.Generator().manual_seed(seed)

    def text(lo: int, hi: int) -> str:
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        return " ".join(f"t{i}" for i in torch.randint(3, U.VOCAB, (length,), generator=gen).tolist())

    rows = []
    for i in range(n):
        (plo, phi), (clo, chi) = ((8, 14), (8, 16)) if i % 2 == 0 else ((2, 3), (1, 3))
        rows.append({"prompt": text(plo, phi), "completion": " " + text(clo, chi), "label": LABELS[i % len(LABELS)]})
    return rows


def kto_config(
    out_dir: str, *, sp: int = 1, steps: int = 3, zero: int | None = None, sp_options: dict | None = None, **extra: Any
):
    from trl import KTOConfig

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
        "parallelism_config": U.parallelism_config(sp, sp_options if sp > 1 else None),
        **_zero3_args(zero),
    }
    return KTOConfig(out_dir, **{**fields, **extra})


class GradRecorder:
    """A `TrainerCallback`: every trainable parameter's gradient just before each optimizer step (after the
    data-parallel engine averaged it)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        recorder = self
        self.steps: list[dict[str, torch.Tensor]] = []

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
                recorder.steps.append(grads)

        self.callback = Callback()


def _reference_model(arch: str | None) -> torch.nn.Module:
    """A reference with other weights and a 3x sharper LM head: on these random tokens it assigns lower
    log-probs than the policy, so KTO's KL estimate is positive (clamped at 0 otherwise) and enters the loss."""
    from tests._sequence_models import sequence_model

    model = sequence_model(arch, seed=1) if arch else tiny_model("llama", seed=1)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(3.0)
    return model


def _spans(batch: dict[str, Any]) -> list[list[int]]:
    """Per row of a full batch: [completion start, row end, padded batch length]."""
    start = batch["completion_mask"].argmax(dim=1)
    end = batch["attention_mask"].sum(dim=1)
    return [[int(s), int(e), int(batch["input_ids"].shape[1])] for s, e in zip(start, end, strict=True)]


def run_kto(
    out_dir: str,
    *,
    sp: int = 1,
    reference: str = "model",
    arch: str | None = None,
    evaluate: bool = False,
    zero: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Train the tiny llama with TRL's KTOTrainer (SGD, no clipping); see the module docstring for what it returns.

    reference: "model" (a separate reference model), "peft" (LoRA via `peft_config`: the reference is the policy
    with its adapter disabled) or "precompute" (a separate reference model whose log-probs, KL pairs included, TRL
    precomputes before training). arch: another tiny model for both (e.g. "moe:qwen3_moe", router loss on).
    """
    from trl import KTOTrainer

    from tests._sequence_models import sequence_model

    data_dir = os.path.dirname(out_dir)
    kwargs: dict[str, Any] = {"model": sequence_model(arch, seed=0) if arch else tiny_model("llama", seed=0)}
    if reference == "peft":
        kwargs["peft_config"] = DJ._lora()
    else:
        kwargs["ref_model"] = _reference_model(arch)
    args = kto_config(out_dir, sp=sp, zero=zero, precompute_ref_log_probs=reference == "precompute", **extra)
    grads = GradRecorder()
    trainer = KTOTrainer(
        args=args,
        train_dataset=DJ._dataset(data_dir, "kto_train", kto_rows(24)),
        eval_dataset=DJ._dataset(data_dir, "kto_eval", kto_rows(6, seed=22)) if evaluate else None,
        processing_class=SU.tiny_tokenizer(),
        callbacks=[] if zero == 3 else [grads.callback],
        **kwargs,
    )
    spans: list[list[list[int]]] = []
    collate = trainer.data_collator

    def recording(features: list[Any]) -> dict[str, Any]:
        batch = collate(features)
        spans.append(_spans(batch))  # the full batch, before any SP sharding
        return batch

    trainer.data_collator = recording
    trainer.train()
    evaluated = trainer.evaluate() if evaluate else {}
    model = trainer.accelerator.unwrap_model(trainer.model)
    weights = {}
    if zero == 3:
        for name, param in model.named_parameters():
            if param.requires_grad:
                with DJ._gathered(param, zero):
                    weights[name] = param.detach().clone()
    attn = model.config._attn_implementation
    patched = sorted(name for name in PATCHED if name in vars(trainer))
    hf_longctx.integrations.trainer.detach(trainer)
    undone = {
        "patched": patched,
        "left": sorted(name for name in PATCHED if name in vars(trainer)),
        "collator": type(trainer.data_collator).__name__,
    }
    return {
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "eval": {k: v for k, v in evaluated.items() if not k.endswith(("_runtime", "_per_second"))},
        "grads": grads.steps,
        "weights": weights,
        "spans": spans,
        "attn": attn,
        "undone": undone,
    }


def refused_option_error(out_dir: str, **options: Any) -> str | None:
    """The `NotImplementedError` message of a KTOTrainer built under SP=2 with `options` (None: it was built)."""
    from trl import KTOTrainer

    try:
        KTOTrainer(
            model=tiny_model("llama"),
            ref_model=tiny_model("llama", seed=1),
            args=kto_config(out_dir, sp=2, steps=1),
            train_dataset=DJ._dataset(os.path.dirname(out_dir), "kto_train", kto_rows(24)),
            processing_class=SU.tiny_tokenizer(),
            **options,
        )
    except NotImplementedError as exc:
        return str(exc)
    return None


def kto_worker(rank: int, world_size: int, out_dir: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Run every named `run_kto` configuration in order (each in `out_dir/name`; a ZeRO configuration must come
    last: it leaves accelerate's state configured for DeepSpeed); at SP=2 first build one KTOTrainer with a
    refused option (`refused`)."""
    results: dict[str, Any] = {}
    if world_size == 2:
        results["refused"] = refused_option_error(os.path.join(out_dir, "refused"), compute_metrics=lambda p: {})
    for name, config in configs.items():
        results[name] = run_kto(os.path.join(out_dir, name), **config)
    return results

"""A ZeRO-3 resume the way a Trainer user writes it: the same script, another sp_size, no conversion step.

`resume_job` is `_fault_jobs.train_job`'s run (tiny llama, AdamW, linear decay, DeepSpeed ZeRO-3 on CPU) with
an hf_longctx `ParallelismConfig(sp_size=sp)` at every sp_size (SP=1 included), the DeepSpeed config without
`checkpoint.load_universal`, and `trainer.train(resume_from_checkpoint=<path>)`; `optim` / `optim_args` are
TrainingArguments' (the checkpoint's optimizer). `refusal_job` returns the ValueError's message instead (one
Trainer per process: accelerate refuses a second DeepSpeed Accelerator).
"""

from __future__ import annotations

import os
from typing import Any

import hf_longctx
from tests.dist import _fault_jobs as J
from tests.dist import _trainer_utils as U


def resume_job(
    rank: int,
    world_size: int,
    out_dir: str,
    *,
    sp: int,
    checkpoint: str,
    optim: str = "adamw_torch",
    optim_args: str | None = None,
) -> dict[str, Any]:
    """Continue the SP=2 run from `checkpoint` at `sp` on `world_size` ranks; return logs and rows."""
    trainer, collator = _trainer(out_dir, sp, optim, optim_args)
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, checkpoint))
    return {"logs": U.logged_steps(trainer, ("loss", "grad_norm")), **collator.take()}


def refusal_job(rank: int, world_size: int, out_dir: str, *, sp: int, optim_args: str | None) -> tuple[str | None, str]:
    """Resume the SGD run in `out_dir` from checkpoint-2 at `sp`: the ValueError's message (None if it resumed)
    and the class of what wraps the model then (a DeepSpeed engine once DeepSpeed has started)."""
    trainer, _ = _trainer(out_dir, sp, "sgd", optim_args)
    message = None
    try:
        trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    except ValueError as exc:
        message = str(exc)
    return message, type(trainer.model_wrapped).__name__


def _trainer(out_dir: str, sp: int, optim: str, optim_args: str | None) -> tuple[Any, U.RecordingCollator]:
    from transformers import Trainer, TrainingArguments

    from tests._models import tiny_model

    model = tiny_model("llama")
    collator = U.RecordingCollator()
    args = TrainingArguments(
        output_dir=out_dir,
        report_to=[],
        disable_tqdm=True,
        seed=1,
        per_device_train_batch_size=U.BATCH,
        gradient_accumulation_steps=J.GA,
        max_steps=J.STEPS,
        optim=optim,
        optim_args=optim_args,
        learning_rate=U.LR[optim],
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        parallelism_config=hf_longctx.ParallelismConfig(sp_size=sp),
        **J._zero3_args(universal=False),
    )
    trainer = Trainer(model=model, args=args, train_dataset=U.dataset("mixed", J.ROWS), data_collator=collator)
    return trainer, collator

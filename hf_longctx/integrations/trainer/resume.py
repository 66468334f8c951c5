"""Resuming under SP: checkpoints record the parallel layout, and a resume may change SP but not the global batch.

A Trainer checkpoint holds whole tensors (model weights, optimizer state: DDP saves them from rank 0; with
ZeRO-3, see the README on universal checkpoints), so it resumes at any SP size. What must not change is the
global batch, `per_device_train_batch_size x gradient_accumulation_steps x DP` with DP = world / sp: the
Trainer skips `global_step x gradient_accumulation_steps` batches per DP rank on resume, so another global
batch would skip or repeat samples and change every later step. hf_longctx refuses such a resume with the
setting that keeps the global batch (`check_resume_layout`), rather than silently changing the user's
gradient accumulation.

`SequenceParallelLayout` is a Trainer callback whose state the Trainer writes into every checkpoint's
`trainer_state.json` (`stateful_callbacks`) and reads back on resume. `UniversalCheckpointFix` repairs the
optimizer state DeepSpeed's ZeRO-3 universal-checkpoint loader leaves behind (see `_compat.untie_optimizer_steps`);
SP runs get both, a run without SP can add the second itself.
"""

from __future__ import annotations

import weakref
from typing import Any

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hf_longctx import _compat


def current_layout(args: Any) -> dict[str, int]:
    """The parallel layout and global batch of a run, from its `TrainingArguments`."""
    sp = int(getattr(args.parallelism_config, "sp_size", 1) or 1)
    dp = max(args.world_size // sp, 1)
    per_device, ga = args.per_device_train_batch_size, args.gradient_accumulation_steps
    return {
        "sp_size": sp,
        "dp_size": dp,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": ga,
        "global_batch_size": per_device * ga * dp,
    }


def check_resume_layout(saved: dict[str, int], current: dict[str, int]) -> None:
    """Raise unless `current` keeps the global batch of the checkpoint's layout `saved`.

    Raises:
        ValueError: naming both layouts and the gradient_accumulation_steps (or per-device batch size)
            that restores the checkpoint's global batch at the current DP size.
    """
    want = saved["global_batch_size"]
    if current["global_batch_size"] == want:
        return
    dp, ga = current["dp_size"], current["gradient_accumulation_steps"]
    per_device = current["per_device_train_batch_size"]
    fixes = []
    if want % (per_device * dp) == 0:
        fixes.append(f"gradient_accumulation_steps={want // (per_device * dp)}")
    if want % (ga * dp) == 0:
        fixes.append(f"per_device_train_batch_size={want // (ga * dp)}")
    fix = (
        f"set {' or '.join(fixes)}" if fixes else f"launch a world size whose DP size (world / sp_size) divides {want}"
    )
    raise ValueError(
        f"This checkpoint was trained with a global batch of {want} sequences per optimizer step "
        f"({_describe(saved)}), but this run has {current['global_batch_size']} ({_describe(current)}). Resuming "
        "would skip or repeat samples and change every later step. Keep the global batch: "
        f"{fix}. Changing sp_size alone needs no change."
    )


def _describe(layout: dict[str, int]) -> str:
    return (
        f"per_device_train_batch_size={layout['per_device_train_batch_size']} x gradient_accumulation_steps="
        f"{layout['gradient_accumulation_steps']} x DP={layout['dp_size']}; sp_size={layout['sp_size']}"
    )


class SequenceParallelLayout(TrainerCallback, ExportableState):
    """Writes the run's layout into each checkpoint; on resume, refuses a layout with another global batch."""

    def __init__(self) -> None:
        self.layout: dict[str, int] | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        # On resume `state` was read from the checkpoint, so it holds the layout saved there; a fresh run
        # holds this callback's own state from before training (None).
        saved = (state.stateful_callbacks or {}).get(type(self).__name__) or {}
        saved_layout = saved.get("attributes", {}).get("layout") if isinstance(saved, dict) else None
        self.layout = current_layout(args)
        if saved_layout:
            check_resume_layout(saved_layout, self.layout)

    def state(self) -> dict[str, Any]:
        return {"args": {}, "attributes": {"layout": self.layout}}


class UniversalCheckpointFix(TrainerCallback):
    """After a resume, give every parameter partition its own AdamW `step` (DeepSpeed ZeRO-3 universal load).

    Add it to a Trainer that resumes from a DeepSpeed universal checkpoint without SP; under SP hf_longctx
    adds it itself.
    """

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # Runs after the Trainer (and DeepSpeed) loaded the checkpoint, before the first step.
        if optimizer is not None:
            _compat.untie_optimizer_steps(optimizer)


def track_layout(trainer: Any, undo: list[Any]) -> None:
    """Add `SequenceParallelLayout` and `UniversalCheckpointFix` to `trainer` once; `undo` gets their removal."""
    ref = weakref.ref(trainer)  # the SP state must not keep the Trainer alive
    for cls in (SequenceParallelLayout, UniversalCheckpointFix):
        if any(isinstance(cb, cls) for cb in trainer.callback_handler.callbacks):
            continue
        callback = cls()
        trainer.add_callback(callback)
        undo.append(lambda callback=callback: ref() is not None and ref().remove_callback(callback))

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

ZeRO partitions parameters and optimizer state over every rank, so its checkpoint loads only at the DP world
size that saved it (DeepSpeed's own error names no fix). `Trainer.train` is patched (`install_resume_patch`,
from `attach`, at any sp_size) so that a resume whose world size differs from the checkpoint's converts it
once with DeepSpeed's `ds_to_universal` (rank 0, beside the checkpoint, the other ranks waiting within the job's
timeout) and loads it universally; a failed conversion raises on every rank with the command to run by hand.
An optimizer whose state the universal format cannot carry (anything but Adam's moments: SGD) is refused on
every rank before the conversion and before DeepSpeed starts, with what works instead.
"""

from __future__ import annotations

import datetime
import glob
import os
import shlex
import subprocess
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from hf_longctx import _compat
from hf_longctx._patching import Patch
from hf_longctx.distributed import comm
from hf_longctx.distributed.failures import CollectiveError

UNIVERSAL_LATEST = "latest_universal"  # the tag file ds_to_universal writes and DeepSpeed's universal load reads


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


def zero_checkpoint_folder(checkpoint: str) -> str | None:
    """The DeepSpeed tag folder (`global_stepN`) inside a Trainer checkpoint, or None if it holds none."""
    latest = os.path.join(checkpoint, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tags = [f.read().strip()]
    else:
        tags = [os.path.basename(p) for p in glob.glob(os.path.join(checkpoint, "global_step*"))]
        tags = [t for t in tags if not t.endswith("_universal")]
    folders = [os.path.join(checkpoint, t) for t in tags if t and os.path.isdir(os.path.join(checkpoint, t))]
    return folders[0] if len(folders) == 1 else None


def saved_zero_world_size(folder: str) -> int:
    """How many DP ranks saved a ZeRO checkpoint: one optimizer partition file each (DeepSpeed's naming)."""
    return len(glob.glob(os.path.join(folder, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")))


def universal_command(folder: str) -> str:
    """DeepSpeed's own conversion of the tag folder `folder` to a universal checkpoint, as a shell command."""
    return (
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {shlex.quote(folder)} "
        f"--output_folder {shlex.quote(folder + '_universal')}"
    )


def prepare_universal_resume(trainer: Any, checkpoint: str) -> bool:
    """Make a ZeRO checkpoint saved at another world size loadable here; True when it must load universally.

    Converts it (once, on rank 0, every rank waiting) unless it already carries a universal copy.

    Raises:
        RuntimeError: on every rank, when the conversion failed or did not finish within the job's
            timeout, naming the command that converts it by hand.
    """
    config = _compat.trainer_deepspeed_config(trainer)
    folder = zero_checkpoint_folder(checkpoint) if config is not None else None
    saved = saved_zero_world_size(folder) if folder is not None else 0
    wanted = bool((config or {}).get("checkpoint", {}).get("load_universal", False))
    if not saved or (saved == trainer.args.world_size and not wanted):
        return False
    if not os.path.isfile(os.path.join(checkpoint, UNIVERSAL_LATEST)):
        what = f"saved by {saved} DP ranks, resumed by {trainer.args.world_size}"
        check_universal_optimizer(folder, what, trainer.args.optim)
        _convert_once(folder, what)
    return True


def check_universal_optimizer(folder: str, what: str, optim: Any) -> None:
    """Raise unless DeepSpeed's universal format can carry the optimizer state saved in the ZeRO folder `folder`.

    Every rank reads rank 0's optimizer file itself (no collective), so every rank raises the same error.

    Raises:
        ValueError: naming the checkpoint's optimizer state, the run's `optim`, why the conversion cannot work
            and what does: the saved number of processes, or an Adam-family optimizer.
    """
    files = glob.glob(os.path.join(folder, "*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    if not files:  # not a checkpoint the converter can read at all: it says so itself
        return
    keys = _compat.zero_optimizer_state_keys(files[0])
    if keys and all(set(_compat.UNIVERSAL_OPTIMIZER_STATE) <= k for k in keys):
        return
    held = sorted(set().union(*keys))
    state = f"per-parameter state {held}" if held else "no per-parameter state"
    saved = saved_zero_world_size(folder)
    name = getattr(optim, "value", optim)
    raise ValueError(
        f"Cannot resume the ZeRO checkpoint {folder} at another world size ({what}): its optimizer "
        f"(TrainingArguments.optim={name!r} in this run) saved {state}, and DeepSpeed's universal checkpoint, the "
        f"only way to load ZeRO state at another world size, carries Adam's {list(_compat.UNIVERSAL_OPTIMIZER_STATE)} "
        "only: ds_to_universal fails on it with a KeyError, by hand too. Resume on the "
        f"{saved} processes that saved it (ZeRO partitions follow the number of processes, not sp_size), or train "
        "with an Adam-family optimizer (optim='adamw_torch'), whose checkpoints resume at any world size. To "
        "start a new run from these weights instead (optimizer state and schedule restart), consolidate them with "
        "the checkpoint's zero_to_fp32.py (DeepSpeed's)."
    )


def _convert_once(folder: str, what: str) -> None:
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    timeout = _compat.group_timeout(group) or datetime.timedelta(minutes=30)
    command = universal_command(folder)
    error = None
    if group is None or dist.get_rank() == 0:
        # A little under the group's timeout: rank 0 reports its own failure before the others give up.
        error = _run_conversion(folder, 0.9 * timeout.total_seconds())
    fix = f"Convert it by hand, then resume again: {command}"
    try:
        errors = [e for e in comm.all_gather_object(error, group) if e]
    except CollectiveError as exc:
        raise RuntimeError(
            f"Rank 0 did not finish converting the ZeRO checkpoint {folder} ({what}) to DeepSpeed's universal "
            f"format within the job's timeout ({timeout}; TrainingArguments.ddp_timeout). {fix}"
        ) from exc
    if errors:
        raise RuntimeError(
            f"Converting the ZeRO checkpoint {folder} ({what}) to DeepSpeed's universal format failed: "
            f"{errors[0]}. {fix}"
        )
    if not os.path.isfile(os.path.join(os.path.dirname(folder), UNIVERSAL_LATEST)):
        raise RuntimeError(
            f"Rank 0 converted {folder} ({what}) but this rank does not see its universal copy: the checkpoint "
            f"must be on a filesystem every node shares. {fix}"
        )


def _run_conversion(folder: str, timeout_s: float) -> str | None:
    """Run DeepSpeed's converter in a child process; the reason it failed, or None."""
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", folder]
    argv += ["--output_folder", folder + "_universal"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"it ran past {timeout_s:.0f} s"
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"exit status {done.returncode}: {tail[0]}"
    return None


def _train(original: Callable[..., Any]) -> Callable[..., Any]:
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if not _uses_hf_longctx(self) or not resume_from_checkpoint:
            return original(self, resume_from_checkpoint, *args, **kwargs)
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            # None: the Trainer raises its own "no valid checkpoint" below.
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True
        if resume_from_checkpoint is True or not prepare_universal_resume(self, resume_from_checkpoint):
            return original(self, resume_from_checkpoint, *args, **kwargs)
        return _train_universally(self, original, resume_from_checkpoint, *args, **kwargs)

    return train


def _train_universally(trainer: Any, original: Callable[..., Any], checkpoint: str, *args: Any, **kwargs: Any) -> Any:
    """Run `train` with DeepSpeed's universal load on, and the AdamW step repair, for this call only."""
    config = _compat.trainer_deepspeed_config(trainer)
    section = config.setdefault("checkpoint", {})
    before = section.get("load_universal")
    section["load_universal"] = True
    fix = None
    if not any(isinstance(cb, UniversalCheckpointFix) for cb in trainer.callback_handler.callbacks):
        fix = UniversalCheckpointFix()
        trainer.add_callback(fix)
    try:
        return original(trainer, checkpoint, *args, **kwargs)
    finally:
        if fix is not None:
            trainer.remove_callback(fix)
        if before is None:
            section.pop("load_universal", None)
        else:
            section["load_universal"] = before


def _uses_hf_longctx(trainer: Any) -> bool:
    # Only hf_longctx's ParallelismConfig has `sp_upstream` (read by attribute: config.py imports this package).
    config = getattr(trainer.args, "parallelism_config", None)
    return getattr(config, "sp_upstream", True) is False


_RESUME_PATCH: list[Patch] = []


def install_resume_patch() -> None:
    """Patch `Trainer.train` (idempotent): it acts only for Trainers with an hf_longctx `parallelism_config`."""
    from transformers import Trainer

    if not _RESUME_PATCH:
        _RESUME_PATCH.append(Patch(Trainer, "train", _train))
    _RESUME_PATCH[0].apply()


def remove_resume_patch() -> None:
    """Restore `Trainer.train`."""
    while _RESUME_PATCH:
        _RESUME_PATCH.pop().remove()

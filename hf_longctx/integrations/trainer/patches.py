"""The class-level Trainer patches, gated on an attached accelerator, and the Trainer settings SP needs.

Five `Trainer` methods have no registry or hook to plug into, so they are replaced through
`patching.Patch` (reversible, idempotent): `get_sp_size` and `get_total_train_batch_size` (step and
token arithmetic: SP ranks share samples), `_validate_args` (TRL trainers without an exact SP path
refused at construction, `integrations/trl/support.py`; arguments asking for SP that the accelerator did not
take, `first_step.py`), `training_step` (the first step's checks that SP runs, and the line saying how) and
`prediction_step` (evaluation outputs merged over the SP group, once per call however deep a subclass's
`super()` chain is). Each acts only when the trainer's accelerator carries hf_longctx SP (`_validate_args`
also when its arguments ask for it); otherwise it calls the original.

`prepare_trainer` runs at the start of `train()` and of every evaluation: it refuses settings that
would silently give wrong numbers, swaps Trainer's label smoother for one that takes the labels
as hf_longctx delivers them (already shifted on the full sequence) and its NEFTune hook for one scaled
by the whole sequence's length.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from transformers.trainer_pt_utils import LabelSmoother

from hf_longctx._patching import Patch
from hf_longctx.distributed.failures import apply_timeout
from hf_longctx.integrations.trainer.evaluation import full_prediction, observe_num_items, replicated_prediction
from hf_longctx.integrations.trainer.first_step import check_config_applied, verify_first_step
from hf_longctx.integrations.trainer.neftune import use_sp_neftune
from hf_longctx.integrations.trainer.resume import remove_resume_patch, track_layout
from hf_longctx.integrations.trainer.state import SequenceParallelState, _unwrap, sp_state
from hf_longctx.sequence.heads import QUESTION_ANSWERING, TOKEN_CLASSIFICATION, head_of

SHIFTED_LABELS_ATTR = "hf_longctx_takes_shifted_labels"
_FRAMES_ATTR = "_hf_longctx_prediction_frames"


def takes_shifted_labels(loss_func: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that a Trainer `compute_loss_func` uses its `labels` as given, without shifting them.

    Under SP each rank holds a slice of the sequence, so labels are shifted on the full sequence before
    sharding: `compute_loss_func(outputs, labels, num_items_in_batch)` receives `labels[t]` = the token
    that follows position t (`IGNORE_INDEX` where no loss is wanted). A function that shifts again (as
    transformers' `ForCausalLMLoss` does without `shift_labels`) would be silently wrong, so hf_longctx
    refuses an unmarked `compute_loss_func`. Returns `loss_func` itself, marked.
    """
    setattr(loss_func, SHIFTED_LABELS_ATTR, True)
    return loss_func


class ShiftedLabelSmoother(LabelSmoother):
    """transformers' `LabelSmoother` for labels that are already shifted: its `shift_labels=True`
    (what Trainer and TRL pass for causal LMs) would shift them a second time."""

    def __call__(self, model_output: Any, labels: Any, shift_labels: bool = False, num_items_in_batch: Any = None):
        return super().__call__(model_output, labels, shift_labels=False, num_items_in_batch=num_items_in_batch)


def prepare_trainer(trainer: Any, state: SequenceParallelState) -> None:
    """Check a Trainer's settings against SP and adapt the label smoother (idempotent); record the
    parallel layout in checkpoints (`resume.py`) and give every process group `ddp_timeout`.

    Raises:
        ValueError: naming the Trainer option to change.
    """
    args = trainer.args
    if not args.average_tokens_across_devices:
        raise ValueError(
            "Sequence parallelism needs average_tokens_across_devices=True (the loss is a global token mean)."
        )
    loss_func = trainer.compute_loss_func
    kind = head_of(_unwrap(trainer.model))[0]
    whole_row_loss = kind in (TOKEN_CLASSIFICATION, QUESTION_ANSWERING)  # sequence/head_losses.py computes it
    smoothed = kind == TOKEN_CLASSIFICATION and trainer.label_smoother is not None  # QA has no `labels` to smooth
    if whole_row_loss and (loss_func is not None or smoothed):
        raise ValueError(
            f"Under sequence parallelism hf_longctx computes a {kind} head's loss over the whole row; a "
            "compute_loss_func or label_smoothing_factor would compute it from each rank's shard instead: remove "
            "them (or train with sp_size=1)."
        )
    if loss_func is not None and not getattr(loss_func, SHIFTED_LABELS_ATTR, False):
        raise ValueError(
            "compute_loss_func receives labels that hf_longctx has already shifted on the full sequence (each rank "
            "holds only a slice of it), so a loss function that shifts labels itself would be silently wrong. Make "
            "it use `labels` as given and mark it: compute_loss_func=hf_longctx.takes_shifted_labels(my_loss)."
        )
    if not (
        trainer.model_accepts_loss_kwargs
        or loss_func is not None
        or whole_row_loss
        or _vlm_takes_loss_kwargs(trainer, state)
    ):
        raise ValueError(
            f"{type(trainer.model).__name__}.forward does not accept num_items_in_batch (**kwargs), so the loss "
            "cannot be token-weighted across SP ranks; pass compute_loss_func (see hf_longctx.takes_shifted_labels)."
        )
    track_layout(trainer, state.undo)
    use_sp_neftune(trainer, state)
    if args.ddp_timeout != type(args).__dataclass_fields__["ddp_timeout"].default:
        # transformers passes ddp_timeout to init_process_group, but not with use_cpu=True (gloo) nor to a
        # process group that already exists: apply a ddp_timeout the user chose to every group the job uses.
        apply_timeout((None, *state.groups.process_groups()), args.ddp_timeout)
    smoother = trainer.label_smoother
    if smoother is not None and not isinstance(smoother, ShiftedLabelSmoother):
        trainer.label_smoother = ShiftedLabelSmoother(epsilon=smoother.epsilon, ignore_index=smoother.ignore_index)
        ref = weakref.ref(trainer)  # the state must not keep the Trainer (and its accelerator) alive

        def restore() -> None:
            if ref() is not None:
                ref().label_smoother = smoother

        state.undo.append(restore)


def _vlm_takes_loss_kwargs(trainer: Any, state: SequenceParallelState) -> bool:
    """Let a vision-language model's loss be token-weighted over the SP group (True when it is done).

    Qwen2.5-VL, Qwen3-VL and other VLMs set `accepts_loss_kwargs = False`, so Trainer gives them no
    `num_items_in_batch` and each SP rank would average over its own shard's tokens: a wrong loss whenever
    the shards hold different numbers of labels. Their forward does hand `**kwargs` to `loss_function`, so
    under SP Trainer is told to pass it; at gradient_accumulation_steps=1 that is exactly the batch mean
    the model computes without SP, and with accumulation it is the token mean over the accumulated batch,
    as for every text model under hf_longctx.
    """
    import inspect

    from hf_longctx.multimodal.vision import multimodal_model

    model = trainer.accelerator.unwrap_model(trainer.model)
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(model.forward).parameters.values()
    if multimodal_model(model) is None or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return False
    trainer.model_accepts_loss_kwargs = True
    ref = weakref.ref(trainer)
    state.undo.append(lambda: setattr(ref(), "model_accepts_loss_kwargs", False) if ref() is not None else None)
    return True


def _get_sp_size(original):
    def get_sp_size(self) -> int:
        # Our loader yields one shard per batch (DeepSpeed's yields sp micro-batches) and tokens are
        # counted on disjoint shards, so the step count and num_items_in_batch must not see sp.
        return 1 if sp_state(self) is not None else original(self)

    return get_sp_size


def _get_total_train_batch_size(original):
    def get_total_train_batch_size(self, args: Any) -> int:
        state = sp_state(self)
        if state is None:
            return original(self, args)
        prepare_trainer(self, state)
        # SP ranks of a group read the same samples: only world / sp ranks add samples.
        return original(self, args) // state.groups.sp_world_size

    return get_total_train_batch_size


def _validate_args(original):
    def validate_args(self) -> None:
        # Runs inside Trainer.__init__, once the accelerator exists: a TRL trainer without an exact SP
        # path fails here, by name, before any step (hf_longctx.integrations.trl.support).
        original(self)
        check_config_applied(self)  # arguments asking for SP that the accelerator did not take
        state = sp_state(self)
        if state is not None:
            from hf_longctx.integrations.trl.support import check_trainer

            check_trainer(self, state)

    return validate_args


def _training_step(original):
    def training_step(self, model, inputs, *args, **kwargs):
        state = sp_state(self)
        if state is not None and not state.verified:
            # Once per attached accelerator, before the first forward: SP cannot be silently off.
            verify_first_step(self, state, model, inputs)
            state.verified = True
        return original(self, model, inputs, *args, **kwargs)

    return training_step


def _prediction_step(original):
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        state = sp_state(self)
        if state is None:
            return original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        prepare_trainer(self, state)
        # A subclass's override calling super() runs this patch twice: merge once, in the innermost call,
        # so the override post-processes whole-sequence values, and outer calls pass them through.
        frames = self.__dict__.setdefault(_FRAMES_ATTR, [])
        frame = {"merged": False}
        frames.append(frame)
        try:
            with observe_num_items(self) as seen:
                outputs = original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            frames.pop()
        if not frame["merged"] and state.replicated_outputs:
            outputs = replicated_prediction(self, state.groups, outputs)
        elif not frame["merged"]:
            outputs = full_prediction(self, state.groups, inputs, outputs, seen)
        if frames:
            frames[-1]["merged"] = True
        return outputs

    return prediction_step


_TRAINER_PATCHES: dict[tuple[type, str], Patch] = {}


def install_trainer_patches() -> list[Patch]:
    """Patch `Trainer` (and any loaded subclass overriding `prediction_step`); idempotent."""
    from transformers import Trainer

    wanted = [
        (Trainer, "get_sp_size", _get_sp_size),
        (Trainer, "get_total_train_batch_size", _get_total_train_batch_size),
        (Trainer, "_validate_args", _validate_args),
        (Trainer, "training_step", _training_step),
    ]
    wanted += [
        (owner, "prediction_step", _prediction_step)
        for owner in (Trainer, *_subclasses_defining(Trainer, "prediction_step"))
    ]
    for owner, name, make in wanted:
        patch = _TRAINER_PATCHES.setdefault((owner, name), Patch(owner, name, make))
        patch.apply()
    return list(_TRAINER_PATCHES.values())


def remove_trainer_patches() -> None:
    """Restore every patched Trainer method to the original function."""
    for patch in _TRAINER_PATCHES.values():
        patch.remove()
    _TRAINER_PATCHES.clear()
    remove_resume_patch()


def _subclasses_defining(cls: type, name: str) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        todo.extend(sub.__subclasses__())
        if name in sub.__dict__:
            found.append(sub)
    return found

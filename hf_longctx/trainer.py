"""Zero-code hook-up of hf_longctx SP into `transformers.Trainer` / TRL `SFTTrainer`.

Entry: accelerate calls `ParallelismConfig._validate_accelerator(accelerator)` inside
`Accelerator.__init__`; for our backends that calls `attach(config, accelerator)`, which builds
the SP/DP groups and makes instance-level changes to *that* accelerator only (models get Ulysses
attention when prepared; dataloaders are sampled by DP rank and sharded per SP rank; metrics are
gathered SP group first, see `metrics.py`) plus the few
class-level Trainer patches below, which act only when the trainer's accelerator is attached.
`detach(accelerator)` undoes the instance changes and the models' attention.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .attention.registry import SequenceParallelHandle, enable_sequence_parallel
from .comm import all_reduce_sum
from .data.collator import SequenceShardingCollator
from .data.sharding import IGNORE_INDEX
from .groups import SequenceParallelGroups, validate_sp_size
from .memory import apply_memory_flags
from .memory.attach import attach_memory_flags, detach_memory_flags
from .metrics import gather_for_metrics
from .patching import Patch

logger = logging.getLogger(__name__)
STATE_ATTR = "_hf_longctx_state"


@dataclass
class SequenceParallelState:
    """What `attach` installed on one accelerator, and how to undo it."""

    config: Any
    groups: SequenceParallelGroups
    handles: list[SequenceParallelHandle] = field(default_factory=list)
    wrapped: list[str] = field(default_factory=list)

    def enable(self, model: Any) -> None:
        """Switch `model` (unwrapped transformers model) to SP attention once."""
        model = _unwrap(model)
        if getattr(model, "config", None) is None or any(h.model is model for h in self.handles):
            return
        self.handles.append(enable_sequence_parallel(model, self.groups, backend=self.config.sp_backend))
        # Memory flags (tiled loss / MLP, activation offload; hf_longctx/memory): a no-op handle when all off.
        self.handles.append(apply_memory_flags(model, self.config))


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def sp_state(trainer_or_accelerator: Any) -> SequenceParallelState | None:
    """The attached state of a Trainer's (or an Accelerator's) hf_longctx SP, or None."""
    accelerator = getattr(trainer_or_accelerator, "accelerator", trainer_or_accelerator)
    return getattr(accelerator, STATE_ATTR, None)


@contextlib.contextmanager
def _sp_hidden(config: Any) -> Iterator[None]:
    """Show accelerate a config without SP: to it every rank is a data-parallel rank.

    accelerate refuses `sp_size > 1` for any backend but its own while preparing DeepSpeed, and
    its batch-size and mesh arithmetic would count SP ranks; gradients must be averaged over all
    ranks anyway (`sequence_parallel_loss` semantics), which is what a pure-DP view gives.
    """
    sp_size = config.sp_size
    config.sp_size = 1
    if hasattr(config, "_sizes"):
        config._sizes["sp"] = 1
    try:
        yield
    finally:
        config.sp_size = sp_size
        if hasattr(config, "_sizes"):
            config._sizes["sp"] = sp_size


def attach(config: Any, accelerator: Any) -> SequenceParallelState | None:
    """Validate and install hf_longctx SP on `accelerator` (called from `_validate_accelerator`).

    Raises:
        ValueError: the process group and accelerate disagree on the world size (the CPU
            `use_cpu` trap) or `sp_size` does not divide the world.
    """
    launched = dist.get_world_size() if dist.is_available() and dist.is_initialized() else _env_world_size()
    if launched != accelerator.num_processes:
        raise ValueError(
            f"The job has {launched} ranks but accelerate sees {accelerator.num_processes} process(es), so data "
            "would be duplicated and gradients never averaged. On CPU pass use_cpu=True to TrainingArguments/"
            "SFTConfig; with DeepSpeed on CPU create `PartialState(backend='gloo')` first and pass "
            "accelerator_config={'use_configured_state': True}."
        )
    validate_sp_size(config.sp_size, accelerator.num_processes)
    if config.sp_size == 1:
        attach_memory_flags(config, accelerator)  # the memory flags apply without SP too
        return None
    state = SequenceParallelState(config, SequenceParallelGroups.build(config.sp_size))
    _wrap_accelerator(accelerator, state)
    setattr(accelerator, STATE_ATTR, state)
    install_trainer_patches()
    logger.info(
        "hf_longctx: sequence parallelism sp=%d x dp=%d (%s)",
        config.sp_size,
        state.groups.dp_world_size,
        config.sp_backend,
    )
    return state


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _wrap_accelerator(accelerator: Any, state: SequenceParallelState) -> None:
    prepare, prepare_model = accelerator.prepare, accelerator.prepare_model

    def prepare_sp(*args: Any, device_placement: Any = None) -> Any:
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                state.enable(obj)
        with _sp_hidden(state.config):
            return prepare(*args, device_placement=device_placement)

    def prepare_model_sp(model: Any, *args: Any, **kwargs: Any) -> Any:
        state.enable(model)
        return prepare_model(model, *args, **kwargs)

    def prepare_data_loader_sp(
        data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        return _prepare_data_loader(accelerator, state.groups, data_loader, device_placement, slice_fn_for_dispatch)

    accelerator.prepare = prepare_sp
    accelerator.prepare_model = prepare_model_sp
    accelerator.prepare_data_loader = prepare_data_loader_sp
    accelerator.gather_for_metrics = functools.partial(
        gather_for_metrics, accelerator, state.groups, accelerator.gather_for_metrics
    )
    state.wrapped += ["prepare", "prepare_model", "prepare_data_loader", "gather_for_metrics"]


def _prepare_data_loader(
    accelerator: Any, groups: SequenceParallelGroups, data_loader: Any, device_placement: Any, slice_fn: Any
) -> Any:
    """accelerate's `prepare_data_loader`, sampled by DP rank only and sharded by SP rank."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.utils import DistributedType

    if getattr(data_loader, "_is_accelerate_prepared", False):
        if data_loader not in accelerator._dataloaders:
            accelerator._dataloaders.append(data_loader)
        return data_loader
    if accelerator.dispatch_batches:
        raise ValueError(
            "dispatch_batches=True is not supported with sequence parallelism: every SP rank must load the "
            "batch itself; set accelerator_config={'dispatch_batches': False}."
        )
    if not isinstance(data_loader.collate_fn, SequenceShardingCollator):
        data_loader.collate_fn = SequenceShardingCollator(data_loader.collate_fn, groups.sp_rank, groups.sp_world_size)
    if device_placement is None:
        device_placement = (
            accelerator.device_placement if accelerator.distributed_type != DistributedType.XLA else False
        )
    prepared = prepare_data_loader(
        data_loader,
        accelerator.device,
        num_processes=groups.dp_world_size,
        process_index=groups.dp_rank,
        split_batches=accelerator.split_batches,
        put_on_device=device_placement,
        rng_types=accelerator.rng_types.copy(),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        slice_fn_for_dispatch=slice_fn,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
        torch_device_mesh=None,
    )
    accelerator._dataloaders.append(prepared)
    return prepared


def detach(trainer_or_accelerator: Any) -> None:
    """Undo `attach`: restore the accelerator's methods and every prepared model's attention."""
    accelerator = getattr(trainer_or_accelerator, "accelerator", trainer_or_accelerator)
    detach_memory_flags(accelerator)
    state = sp_state(accelerator)
    if state is None:
        return
    for handle in state.handles:
        handle.remove()
    for name in state.wrapped:
        accelerator.__dict__.pop(name, None)
    delattr(accelerator, STATE_ATTR)


# ---- class-level Trainer patches (gated on an attached accelerator) ---------------------------


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
        _check_trainer_settings(self)
        # SP ranks of a group read the same samples: only world / sp ranks add samples.
        return original(self, args) // state.groups.sp_world_size

    return get_total_train_batch_size


def _check_trainer_settings(trainer: Any) -> None:
    if not trainer.args.average_tokens_across_devices:
        raise ValueError(
            "Sequence parallelism needs average_tokens_across_devices=True (the loss is a global token mean)."
        )
    if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        raise ValueError(
            f"{type(trainer.model).__name__}.forward does not accept num_items_in_batch (**kwargs), so the loss "
            "cannot be token-weighted across SP ranks; pass compute_loss_func to the Trainer."
        )


def _prediction_step(original):
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        state = sp_state(self)
        if state is None:
            return original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        with _observe_num_items(self) as seen:
            loss, logits, labels = original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if loss is None or "shift_labels" not in inputs:
            return loss, logits, labels
        # Return this rank's share of its DP rank's loss: our gather_for_metrics sums the SP group.
        if seen.get("num_items") is not None and self.args.average_tokens_across_devices:
            # compute_loss returned world * (shard sum) / (global count): every rank is an equal share.
            return loss / state.groups.sp_world_size, logits, labels
        # compute_loss returned the shard's token mean: weight it by the shard's share of the tokens.
        count = (inputs["shift_labels"] != IGNORE_INDEX).sum().to(loss.device, torch.float64)
        total = all_reduce_sum(count, state.groups.sp_group)
        share = torch.where(count > 0, loss.detach().to(torch.float64) * count, 0.0) / total.clamp(min=1)
        return share.to(loss.dtype), logits, labels

    return prediction_step


@contextlib.contextmanager
def _observe_num_items(trainer: Any) -> Iterator[dict[str, Any]]:
    """Record the `num_items_in_batch` that `prediction_step` hands to `compute_loss` (transformers 5.x
    passes the global count; TRL's override passes none), which decides what the returned loss means."""
    seen: dict[str, Any] = {}
    previous = trainer.__dict__.get("compute_loss")
    compute_loss = trainer.compute_loss

    def recording(*args: Any, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        seen["num_items"] = num_items_in_batch
        return compute_loss(*args, num_items_in_batch=num_items_in_batch, **kwargs)

    trainer.compute_loss = recording
    try:
        yield seen
    finally:
        if previous is None:
            del trainer.compute_loss
        else:
            trainer.compute_loss = previous


_TRAINER_PATCHES: dict[tuple[type, str], Patch] = {}


def install_trainer_patches() -> list[Patch]:
    """Patch `Trainer` (and any loaded subclass overriding `prediction_step`); idempotent."""
    from transformers import Trainer

    wanted = [
        (Trainer, "get_sp_size", _get_sp_size),
        (Trainer, "get_total_train_batch_size", _get_total_train_batch_size),
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


def _subclasses_defining(cls: type, name: str) -> list[type]:
    found, todo = [], list(cls.__subclasses__())
    while todo:
        sub = todo.pop()
        todo.extend(sub.__subclasses__())
        if name in sub.__dict__:
            found.append(sub)
    return found

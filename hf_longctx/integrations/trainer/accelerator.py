"""Accelerator wiring: `attach` installs hf_longctx SP on one `Accelerator`, `detach` undoes it.

accelerate calls `ParallelismConfig._validate_accelerator(accelerator)` inside `Accelerator.__init__`;
for our backends that calls `attach`, which builds the SP/DP groups and replaces a few methods on
*that* accelerator instance only: `prepare`/`prepare_model` switch models to SP attention,
`prepare_data_loader` samples by DP rank and shards by SP rank (`dataloader.py`),
`gather_for_metrics` merges the SP group first (`metrics.py`), and `unwrap_model` checks the model
the first time the Trainer looks at it. Everything attach creates is released by `detach`, when
the accelerator is garbage collected, or at interpreter exit, whichever comes first.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from hf_longctx.distributed.failures import shutdown_process_groups
from hf_longctx.distributed.groups import SequenceParallelGroups, validate_sp_size
from hf_longctx.integrations.trainer.dataloader import prepare_data_loader
from hf_longctx.integrations.trainer.metrics import gather_for_metrics
from hf_longctx.integrations.trainer.patches import install_trainer_patches
from hf_longctx.integrations.trainer.single import attach_single, detach_single
from hf_longctx.integrations.trainer.state import STATE_ATTR, SequenceParallelState, sp_hidden, sp_state

logger = logging.getLogger(__name__)
EXIT_DRAIN_S = 0.1  # see _destroy_default_group_at_exit


def attach(config: Any, accelerator: Any) -> SequenceParallelState | None:
    """Validate and install hf_longctx SP on `accelerator` (called from `_validate_accelerator`).

    Raises:
        ValueError: the process group and accelerate disagree on the world size (the CPU
            `use_cpu` trap), accelerate runs no data-parallel engine over several ranks, or `sp_size` does not
            divide the world.
    """
    launched = dist.get_world_size() if dist.is_available() and dist.is_initialized() else _env_world_size()
    if launched != accelerator.num_processes:
        raise ValueError(
            f"The job has {launched} ranks but accelerate sees {accelerator.num_processes} process(es), so data "
            "would be duplicated and gradients never averaged. On CPU pass use_cpu=True to TrainingArguments/"
            "SFTConfig; with DeepSpeed on CPU create `PartialState(backend='gloo')` first and pass "
            "accelerator_config={'use_configured_state': True}."
        )
    from accelerate.utils import DistributedType

    if launched > 1 and accelerator.distributed_type == DistributedType.NO:
        # Seen with ddp_backend="gloo" and use_cpu=False on CPU: accelerate counts the ranks but wraps no DDP.
        raise ValueError(
            f"The job has {launched} ranks but accelerate runs no data-parallel engine (DistributedType.NO), so "
            "gradients would never be averaged across them. On CPU pass use_cpu=True to TrainingArguments/SFTConfig "
            "(gloo); on GPUs leave ddp_backend unset (NCCL)."
        )
    validate_sp_size(config.sp_size, accelerator.num_processes)
    from hf_longctx.integrations.trainer.resume import install_resume_patch

    install_resume_patch()  # a ZeRO resume at another world size, at any sp_size (resume.py)
    if config.sp_size == 1:
        attach_single(config, accelerator)  # hf_longctx's attention (no [S, S] mask) and the memory flags
        return None
    state = SequenceParallelState(config, SequenceParallelGroups.build(config.sp_size))
    _wrap_accelerator(accelerator, state)
    setattr(accelerator, STATE_ATTR, state)
    # Released when the accelerator is collected or, at the latest, at interpreter exit (weakref.finalize
    # runs pending finalizers at exit); `state.close` holds no reference to the accelerator.
    weakref.finalize(accelerator, state.close)
    _destroy_default_group_at_exit()
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


@functools.cache
def _destroy_default_group_at_exit() -> None:
    """Once per process: shut torch.distributed down at exit if the job left it running.

    Neither Trainer nor accelerate destroys the default process group, and a gloo group still alive
    at interpreter exit can abort the process ("terminate called without an active exception",
    SIGABRT; measured on CPU in about 1 run of 3 after `evaluate()`), which torchrun reports as a
    failed job. At exit no collective can follow, so destroying it then is safe.
    """

    def shutdown() -> None:
        if dist.is_available() and dist.is_initialized():
            # A gloo worker thread frees each finished collective after the caller's wait() returned, and
            # freeing a tensor Python has dropped needs the GIL. If the job's last collective ran just before
            # exit, that thread can still be waiting for the GIL when finalisation starts, and Python then
            # ends it mid-destructor: std::terminate, SIGABRT (seen in a core dump of this job: gloo's
            # runLoop -> ~AsyncAllgatherWork -> take_gil during Py_FinalizeEx; 4 of 15 runs). Sleeping
            # releases the GIL so such a thread finishes first.
            time.sleep(EXIT_DRAIN_S)
            shutdown_process_groups()  # bounded: after a failure an NCCL destroy waits for the dead peer

    atexit.register(shutdown)


def _wrap_accelerator(accelerator: Any, state: SequenceParallelState) -> None:
    prepare, prepare_model = accelerator.prepare, accelerator.prepare_model
    unwrap_model = accelerator.unwrap_model

    def prepare_sp(*args: Any, device_placement: Any = None) -> Any:
        for obj in args:
            if isinstance(obj, torch.nn.Module):
                state.enable(obj)
        with sp_hidden(state.config):
            return prepare(*args, device_placement=device_placement)

    def prepare_model_sp(model: Any, *args: Any, **kwargs: Any) -> Any:
        state.enable(model)
        return prepare_model(model, *args, **kwargs)

    def prepare_data_loader_sp(
        data_loader: Any, device_placement: Any = None, slice_fn_for_dispatch: Any = None
    ) -> Any:
        return prepare_data_loader(accelerator, state, data_loader, device_placement, slice_fn_for_dispatch)

    def unwrap_model_sp(model: Any, *args: Any, **kwargs: Any) -> Any:
        # Trainer.__init__ unwraps the model to inspect it: the first moment SP sees it, before any weight
        # is moved or wrapped, so a model SP cannot run (heads, kernel) fails here rather than at train().
        unwrapped = unwrap_model(model, *args, **kwargs)
        state.check(unwrapped)
        return unwrapped

    accelerator.prepare = prepare_sp
    accelerator.prepare_model = prepare_model_sp
    accelerator.prepare_data_loader = prepare_data_loader_sp
    accelerator.unwrap_model = unwrap_model_sp
    accelerator.gather_for_metrics = functools.partial(gather_for_metrics, accelerator, state.groups)
    state.wrapped += ["prepare", "prepare_model", "prepare_data_loader", "unwrap_model", "gather_for_metrics"]


def detach(trainer_or_accelerator: Any) -> None:
    """Undo `attach`: the accelerator's methods, every prepared model's attention, the data loaders'
    collate functions and the Trainer attributes hf_longctx replaced; then destroy the SP/DP groups.

    After it the model runs in a single process again (e.g. `generate`); a Trainer used after it
    trains without SP.
    """
    accelerator = getattr(trainer_or_accelerator, "accelerator", trainer_or_accelerator)
    detach_single(accelerator)
    state = sp_state(accelerator)
    if state is None:
        return
    for name in state.wrapped:
        accelerator.__dict__.pop(name, None)
    delattr(accelerator, STATE_ATTR)
    if trainer_or_accelerator is not accelerator and hasattr(trainer_or_accelerator, "gather_function"):
        # Trainer.__init__ bound gather_function to the SP gather_for_metrics: point it back, as Trainer does.
        trainer_or_accelerator.gather_function = accelerator.gather_for_metrics
    state.close()

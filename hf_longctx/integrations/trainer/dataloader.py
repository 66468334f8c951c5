"""DataLoaders under SP: sampled by data-parallel rank only, sharded by sequence-parallel rank.

The SP ranks of a group must read the same samples in the same order (they split one sequence), so
accelerate's `prepare_data_loader` is called with the DP world instead of the full world, and the
collate function is wrapped to keep this rank's slice (`data.collator.SequenceShardingCollator`).
Sharding inside the collate function keeps every loader feature that rebuilds loaders from their
`collate_fn` (`skip_first_batches` on resume, workers, stateful loaders). A batch sampler that is
already rank-aware (transformers' `BatchRebalanceSampler`) is made to count DP ranks only.
"""

from __future__ import annotations

import weakref
from typing import Any

from hf_longctx import _compat
from hf_longctx.data.collator import SequenceShardingCollator
from hf_longctx.data.validation import check_loader_not_empty
from hf_longctx.integrations.trainer.state import SequenceParallelState


def _shard_collate(loader: Any, state: SequenceParallelState) -> None:
    """Wrap `loader.collate_fn` so it returns this rank's shard; `detach` restores the original."""
    current = loader.collate_fn
    inner = current.collate_fn if isinstance(current, SequenceShardingCollator) else current
    if not isinstance(current, SequenceShardingCollator):
        groups = state.groups
        loader.collate_fn = SequenceShardingCollator(
            inner, groups.sp_rank, groups.sp_world_size, layout=groups.layout_slot
        )
    ref = weakref.ref(loader)  # Trainer builds new loaders per train()/evaluate(): do not keep old ones alive

    def restore() -> None:
        if ref() is not None:
            ref().collate_fn = inner

    state.undo.append(restore)


def prepare_data_loader(
    accelerator: Any, state: SequenceParallelState, data_loader: Any, device_placement: Any, slice_fn: Any
) -> Any:
    """accelerate's `prepare_data_loader`, sampled by DP rank only and sharded by SP rank.

    Raises:
        ValueError: `dispatch_batches=True` (one rank would load and slice batches for the others), or the
            loader yields no batch (every rank sees the same dataset, so every rank raises).
    """
    from accelerate.data_loader import prepare_data_loader as accelerate_prepare
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
    check_loader_not_empty(data_loader)
    groups = state.groups
    # train_sampling_strategy="batch_rebalance": the Trainer built it for world-many DP ranks (SP ranks would read
    # different samples) and disarms accelerate's sharding of it after this call, finding it by identity.
    batch_sampler = getattr(data_loader, "batch_sampler", None)
    _compat.rebalance_for_data_parallel(batch_sampler, groups.dp_world_size, groups.dp_rank)
    _shard_collate(data_loader, state)
    if device_placement is None:
        device_placement = (
            accelerator.device_placement if accelerator.distributed_type != DistributedType.XLA else False
        )
    prepared = accelerate_prepare(
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
    _shard_collate(prepared, state)  # accelerate rebuilt the loader around our collator
    accelerator._dataloaders.append(prepared)
    return prepared

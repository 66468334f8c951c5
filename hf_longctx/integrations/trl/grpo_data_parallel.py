"""GRPO's and RLOO's batch and loss code under SP sees the data-parallel world a run without SP would see.

`GRPOTrainer` and `RLOOTrainer` turn processes into data-parallel ranks while they build a batch and its loss:
they slice the gathered rewards by `accelerator.process_index`, divide the gathered token count by
`accelerator.num_processes`, and gather rewards, KL, completion lengths, token counts and metrics over every
process (`accelerator.gather` / `reduce`, and accelerate's module-level `gather` / `gather_object`, which TRL
imported into each trainer's module). Under SP the ranks of a group hold the same prompts and completions, so
over every process each sample would count `sp_size` times: a doubled `num_tokens`, a `reward_std` over
repeated rewards.

`data_parallel_step` wraps the trainer's public `training_step` and `prediction_step` (the two entries into its
batch and loss code) in `data_parallel_view`: inside, `trainer.accelerator` is a `DataParallelAccelerator`
(the DP rank and size; gathers and reductions over the DP group) and TRL's module-level `gather` /
`gather_object` gather over the DP group. Those two are patched on the trainer's module (`trl.trainer.grpo_trainer`,
`trl.trainer.rloo_trainer`: a public accelerate function has no group argument and no hook), inert outside a
view, and restored when the last trainer using them is detached. The generation sizes are the other half
(`online.data_parallel_sizes`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.distributed.comm import all_gather_object, all_gather_stacked, all_reduce_sum
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.trainer.metrics import gather_replicated

# The DP groups of the view in effect (None: outside any view, TRL's functions run unchanged).
_VIEW: contextvars.ContextVar[SequenceParallelGroups | None] = contextvars.ContextVar(
    "hf_longctx_dp_view", default=None
)


def _each(fn: Callable[[torch.Tensor], torch.Tensor], data: Any) -> Any:
    """`fn` applied to every tensor of a nested list / tuple / dict, as accelerate's operations recurse."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        return type(data)(_each(fn, d) for d in data)
    if isinstance(data, dict):
        return type(data)({k: _each(fn, v) for k, v in data.items()})
    raise TypeError(f"cannot gather or reduce a {type(data).__name__} over the data-parallel group")


def dp_gather(data: Any, groups: SequenceParallelGroups) -> Any:
    """accelerate's `gather` over the DP group: every DP rank's tensor concatenated along dim 0 (0-d as 1-d)."""

    def gather(x: torch.Tensor) -> torch.Tensor:
        return all_gather_stacked(x.reshape(1) if x.dim() == 0 else x, groups.dp_group).flatten(0, 1)

    return _each(gather, data)


def dp_gather_object(obj: Any, groups: SequenceParallelGroups) -> list[Any]:
    """accelerate's `gather_object` over the DP group: every DP rank's list, flattened in rank order."""
    return [x for part in all_gather_object(obj, groups.dp_group) for x in part]


def dp_reduce(data: Any, groups: SequenceParallelGroups, reduction: str = "sum") -> Any:
    """accelerate's `Accelerator.reduce` over the DP group ('sum', 'mean' or 'none')."""
    if reduction == "none":
        return data
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")

    def reduce(x: torch.Tensor) -> torch.Tensor:
        total = all_reduce_sum(x, groups.dp_group)
        return total / groups.dp_world_size if reduction == "mean" else total

    return _each(reduce, data)


class DataParallelAccelerator:
    """An accelerator as a run without SP on the DP ranks sees it: its process index and count are the DP
    rank and size, and `gather` / `reduce` / `gather_for_metrics` run over the DP group. Everything else
    (device, autocast, backward, ...) is the accelerator's own; attributes set on the view go to it."""

    def __init__(self, accelerator: Any, groups: SequenceParallelGroups) -> None:
        object.__setattr__(self, "_accelerator", accelerator)
        object.__setattr__(self, "_groups", groups)

    @property
    def num_processes(self) -> int:
        return self._groups.dp_world_size

    @property
    def process_index(self) -> int:
        return self._groups.dp_rank

    def gather(self, tensor: Any) -> Any:
        return dp_gather(tensor, self._groups)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return dp_reduce(tensor, self._groups, reduction)  # `scale` applies on XLA only, as in accelerate

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        # Inside the view every value is whole on each SP rank (GRPO's and RLOO's are): one copy per DP rank.
        return gather_replicated(self._accelerator, self._groups, input_data, use_gather_object)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._accelerator, name, value)


@contextlib.contextmanager
def data_parallel_view(trainer: Any, groups: SequenceParallelGroups) -> Iterator[None]:
    """Inside the block, `trainer.accelerator` and TRL's module-level gathers count DP ranks only."""
    accelerator = trainer.accelerator
    if isinstance(accelerator, DataParallelAccelerator):  # already inside a view (one step calling the other)
        yield
        return
    trainer.accelerator = DataParallelAccelerator(accelerator, groups)
    token = _VIEW.set(groups)
    try:
        yield
    finally:
        _VIEW.reset(token)
        trainer.accelerator = accelerator


def make_data_parallel_step(
    trainer: Any, groups: SequenceParallelGroups
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for `training_step` / `prediction_step`: the original inside `data_parallel_view`."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kwargs: Any) -> Any:
            with data_parallel_view(trainer, groups):
                return original(*args, **kwargs)

        return step

    return make


def _make_module_gather(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def gather(tensor: Any) -> Any:
        groups = _VIEW.get()
        return original(tensor) if groups is None else dp_gather(tensor, groups)

    return gather


def make_module_gather_object(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def gather_object(obj: Any) -> Any:
        groups = _VIEW.get()
        return original(obj) if groups is None else dp_gather_object(obj, groups)

    return gather_object


# Per trainer module: its two gather patches and the number of trainers relying on them.
_MODULE_PATCHES: dict[str, list[Patch]] = {}
_USERS: dict[str, int] = {}


def use_module_gathers(module_name: str = "trl.trainer.grpo_trainer") -> Callable[[], None]:
    """Patch `module_name`'s module-level `gather` / `gather_object` (once per process and module); returns this
    user's release, which restores them when no trainer of that module uses them any more."""
    if module_name not in _MODULE_PATCHES:
        import importlib

        module = importlib.import_module(module_name)
        patches = [
            Patch(module, "gather", _make_module_gather),
            Patch(module, "gather_object", make_module_gather_object),
        ]
        for patch in patches:
            patch.apply()
        _MODULE_PATCHES[module_name] = patches
    _USERS[module_name] = _USERS.get(module_name, 0) + 1
    released = False

    def release() -> None:
        nonlocal released
        if released:
            return
        released = True
        _USERS[module_name] -= 1
        if _USERS[module_name] == 0:
            del _USERS[module_name]
            for patch in reversed(_MODULE_PATCHES.pop(module_name)):
                patch.remove()

    return release

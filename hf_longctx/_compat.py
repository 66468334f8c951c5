"""Every version-dependent access to torch / transformers / accelerate lives here.

Pinned behaviour (transformers 5.x): `ALL_ATTENTION_FUNCTIONS[key] = fn` and `del` touch only
the singleton's instance-local mapping, and `create_causal_mask` builds no mask for a key that
is absent from `ALL_MASK_ATTENTION_FUNCTIONS._global_mapping`. `tests/unit/test_compat.py`
checks both, so an upgrade that changes them fails loudly instead of silently.
"""

from __future__ import annotations

import datetime
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging import version

TRANSFORMERS_VERSION = version.parse(transformers.__version__)
TORCH_VERSION = version.parse(torch.__version__.split("+")[0])
MIN_TRANSFORMERS = version.parse("5.0.0")


def check_versions() -> None:
    """Raise a `ValueError` naming the upgrade when transformers is too old for this plugin."""
    if TRANSFORMERS_VERSION < MIN_TRANSFORMERS:
        raise ValueError(f"hf_longctx needs transformers>={MIN_TRANSFORMERS}; found {transformers.__version__}.")


def attention_registries() -> tuple[Any, Any]:
    """transformers' attention-function and attention-mask registries (singletons)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def resolve_kernel(name: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The attention function a model runs for `name`; "eager" is the modeling file's own function.

    Raises:
        ValueError: no such kernel is registered or defined next to the attention module.
    """
    if name != "eager":
        registry, _ = attention_registries()
        if name in registry:
            return registry[name]
        raise ValueError(f"Attention implementation {name!r} is not registered in transformers.")
    # Models call get_interface(name, eager_attention_forward) with their *own* eager function
    # (some add softcapping or sinks), so take it from the module that defines the attention class.
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(
            f"{type(module).__name__} has no eager_attention_forward next to it; load the model with sdpa."
        )
    return fn


def all_gather_into_tensor() -> Callable[..., Any]:
    """torch.distributed's gather-into-one-tensor collective: `all_gather_single` since torch 2.13 (which
    deprecates the older name with a FutureWarning per call), `all_gather_into_tensor` before."""
    import torch.distributed as dist

    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_timeout(group: Any) -> datetime.timedelta | None:
    """The collective timeout of `group` (None: the default group), or None if torch does not expose it.

    torch has no public getter; each backend keeps the timeout it was created with in `options._timeout`.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in getattr(pg, "_device_types", []):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def set_group_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """Change the collective timeout of an existing group (None: the default group); gloo and NCCL only."""
    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout(timeout, group)


def untie_optimizer_steps(optimizer: Any) -> int:
    """Give each parameter its own optimizer `step` tensor where several share one; return how many were untied.

    DeepSpeed's ZeRO-3 universal-checkpoint loader (0.19.8, `load_hp_checkpoint_state_from_checkpoint_dir_stage3`)
    stores one `step` tensor object in the state of every parameter partition; torch's Adam/AdamW increment it in
    place once per partition, so with two parameter groups (Trainer's decay / no-decay) every later step counts
    twice and the bias correction drifts (measured: loss off by 3e-5 two steps after the resume; untied: bitwise
    equal to the uninterrupted run). A no-op wherever the tensors are distinct.
    """
    inner = optimizer
    while hasattr(inner, "optimizer"):  # accelerate's wrapper, then DeepSpeed's, then the torch optimizer
        inner = inner.optimizer
    seen: set[int] = set()
    untied = 0
    for state in getattr(inner, "state", {}).values():
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
                untied += 1
            seen.add(id(step))
    return untied


# TRL's `add_fused_lm_head` (trl>=1.16) replaces `model.forward` by a closure `_fused_forward`
# whose settings are not stored anywhere else; `tiled_loss` reads them (read-only) to reproduce
# its outputs exactly. Unknown layouts return None and TRL's own path runs unchanged.
TRL_FUSED_SETTINGS = ("temperature", "outputs", "cast_lm_head_to_fp32", "logit_scale", "final_logit_softcapping")


def trl_fused_head_settings(forward: Callable[..., Any]) -> dict[str, Any] | None:
    """The settings TRL's fused LM head was added with, read from its forward's closure, or None."""
    fn = getattr(forward, "__func__", forward)
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None or code.co_name != "_fused_forward":
        return None
    cells = dict(zip(code.co_freevars, closure, strict=True))
    try:
        return {name: cells[name].cell_contents for name in TRL_FUSED_SETTINGS}
    except (KeyError, ValueError):
        return None


def trl_fused_head_uses_triton(device: torch.device) -> bool:
    """True where TRL's fused LM head runs its Triton kernel (it tiles the vocabulary itself)."""
    from transformers.utils import is_triton_available

    return device.type in ("cuda", "xpu") and is_triton_available()


def liger_fused_linear_cross_entropy() -> Callable[..., Any] | None:
    """Liger's functional fused linear cross-entropy when liger-kernel is installed, else None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as fn
    except ImportError:
        return None
    return fn


# flash-attn 2.7.0 is the first release whose private `_flash_attn_*` functions take
# `window_size_left/right` and return 4 values; since then they are `torch.library.custom_op`
# objects, whose Python signature is `(*args, **kwargs)`: their parameters live in the op schema.
MIN_FLASH_ATTN = version.parse("2.7.0")
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def flash_attn_version(module: Any) -> version.Version | None:
    """The flash-attn release a module belongs to (its package's `__version__`), None if it has none (FA3)."""
    package = sys.modules.get(module.__name__.split(".")[0], module)
    found = getattr(package, "__version__", None)
    return version.parse(found) if isinstance(found, str) else None


def op_parameters(fn: Callable[..., Any]) -> dict[str, bool]:
    """Parameter name -> whether it is required, for a plain function or a torch custom / aten op.

    Raises:
        ValueError: `fn` exposes neither a schema nor named parameters.
    """
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)  # torch.library.custom_op
    if schema is None:
        overload = getattr(fn, "default", fn)  # torch.ops.<ns>.<op> packet or overload
        schema = getattr(overload, "_schema", None) if isinstance(overload, torch._ops.OpOverload) else None
    if schema is not None:
        return {arg.name: not arg.has_default_value() for arg in schema.arguments}
    params = inspect.signature(fn).parameters.values()
    named = {p.name: p.default is inspect.Parameter.empty for p in params if p.kind not in _VARIADIC}
    if not named:
        raise ValueError(f"{fn!r} exposes no parameter names (neither a torch op schema nor a Python signature).")
    return named


def abort_process_groups() -> None:
    """Abort every process group without waiting for peers (NCCL: `ncclCommAbort`; gloo closes its pairs).

    torch has no public abort; `distributed_c10d._abort_process_group` (experimental, torch >= 2.4) aborts
    every group. Raises `RuntimeError` where this torch has none.
    """
    import torch.distributed as dist

    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.distributed abort; cannot abort its groups.")
    abort(None)


def has_matmul_out_dtype() -> bool:
    """True where `torch.addmm(..., out_dtype=torch.float32)` exists (CUDA, torch >= 2.8): a bfloat16 matmul
    that accumulates into a float32 tensor without a float32 copy of its operands."""
    return TORCH_VERSION >= version.parse("2.8")


def trainer_deepspeed_config(trainer: Any) -> dict[str, Any] | None:
    """The DeepSpeed config dict a Trainer hands to `deepspeed.initialize`, or None without DeepSpeed.

    accelerate 1.x keeps it as `deepspeed_plugin.hf_ds_config.config` (also `deepspeed_plugin.deepspeed_config`,
    the same object); transformers' `deepspeed_init` finalizes that dict at `train()` before the engine exists.
    """
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return getattr(getattr(plugin, "hf_ds_config", None), "config", None)


# What DeepSpeed's universal checkpoint carries of the optimizer (0.19.8: `ds_to_universal`'s
# `extract_zero_shards_stage3` and ZeRO-3's `load_hp_checkpoint_state_from_checkpoint_dir_stage3` read these keys of
# every parameter partition's state, and `step`): Adam's moments only. Another optimizer's checkpoint fails there
# with a KeyError (SGD: no state at all, or `momentum_buffer`).
UNIVERSAL_OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq")


def zero_optimizer_state_keys(optim_file: str) -> list[set[str]]:
    """The per-parameter-partition state keys in one rank's ZeRO optimizer file (`*_optim_states.pt`).

    Memory-mapped: only the small state index is read, not the partitions (GBs per rank on a large model).
    """
    saved = torch.load(optim_file, map_location="cpu", weights_only=False, mmap=True)
    state = saved["optimizer_state_dict"]["optimizer_state_dict"]["state"]
    groups = len(saved["optimizer_state_dict"]["fp32_flat_groups"])
    return [set(state.get(i, {})) for i in range(groups)]


def rebalance_for_data_parallel(batch_sampler: Any, dp_size: int, dp_rank: int) -> bool:
    """Make transformers' `BatchRebalanceSampler` (5.x, `train_sampling_strategy="batch_rebalance"`) serve
    `dp_size` data-parallel ranks, this one being `dp_rank`, in place; False for any other batch sampler.

    The Trainer builds it with every process as a DP rank; under SP the ranks of a group must read the same
    micro-batches, so only `world / sp` ranks split the effective batch. In place, because the Trainer finds
    the sampler again by identity after `accelerator.prepare` (to keep accelerate from re-sharding it).
    """
    try:
        from transformers.trainer_pt_utils import BatchRebalanceSampler
    except ImportError:  # transformers without it offers no batch_rebalance strategy
        return False
    if not isinstance(batch_sampler, BatchRebalanceSampler):
        return False
    if batch_sampler.dp_size != dp_size:
        per_rank = batch_sampler.effective_batch_size // batch_sampler.dp_size  # micro-batch x accumulation
        batch_sampler.__init__(
            lengths=batch_sampler.lengths,
            effective_batch_size=per_rank * dp_size,
            dp_size=dp_size,
            grad_accum=batch_sampler.grad_accum,
            shuffle=batch_sampler.shuffle,
            seed=batch_sampler.seed,
            rank=dp_rank,
            drop_last=batch_sampler.drop_last,
        )
    return True

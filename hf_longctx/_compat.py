"""Every version-dependent access to torch / transformers / accelerate lives here.

Pinned behaviour (transformers 5.x): `ALL_ATTENTION_FUNCTIONS[key] = fn` and `del` touch only
the singleton's instance-local mapping, and `create_causal_mask` builds no mask for a key that
is absent from `ALL_MASK_ATTENTION_FUNCTIONS._global_mapping`. `tests/unit/test_compat.py`
checks both, so an upgrade that changes them fails loudly instead of silently.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import transformers
from packaging import version

TRANSFORMERS_VERSION = version.parse(transformers.__version__)
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

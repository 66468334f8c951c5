"""Which token mixers outside softmax attention SP can shard, the check that refuses the rest, and the wiring.

`check_token_mixers(model, sp_size)` runs in `check_model` (so at `Trainer(...)` and in `hf-longctx check`):
every module that mixes tokens without transformers' attention interface is either a layer type with a
head-parallel adapter (by class name, `ADAPTERS`) whose heads split over `sp_size`, or a refusal that
names the layer and why. `attach_linear_layers` installs the adapters as reversible instance patches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.attention.kernels import SequenceContext
from hf_longctx.attention.linear import gated_deltanet
from hf_longctx.distributed.groups import SequenceParallelGroups

# Class name -> adapter module (`check_heads(module, name, sp_size)`, `head_parallel_forward(...)`).
ADAPTERS = dict.fromkeys(gated_deltanet.LAYOUTS, gated_deltanet)

_MAMBA2_NORM = (
    "a Mamba2 mixer: its SSD scan has no head-parallel adapter in hf_longctx yet, and its gated RMSNorm (where "
    "configured) normalises over all heads of a group at once (one group by default), which a head split cannot "
    "reproduce without a cross-rank norm"
)
_MAMBA1 = "a Mamba (selective scan) mixer: no head-parallel adapter in hf_longctx yet"
_DELTANET_LATER = (
    "a Gated DeltaNet with its own projection layout: not wired into hf_longctx yet (Qwen3-Next and Qwen3.5 are)"
)
# Token mixers transformers ships that hf_longctx refuses, by class name, with the reason.
REFUSED = {
    "BambaMixer": _MAMBA2_NORM,
    "FalconH1Mixer": _MAMBA2_NORM,
    "Mamba2Mixer": _MAMBA2_NORM,
    "NemotronHMamba2Mixer": _MAMBA2_NORM,
    "Zamba2MambaMixer": _MAMBA2_NORM,
    "GraniteMoeHybridMambaLayer": _MAMBA2_NORM,
    "MambaMixer": _MAMBA1,
    "FalconMambaMixer": _MAMBA1,
    "JambaMambaMixer": _MAMBA1,
    "ZambaMambaMixer": _MAMBA1,
    "OlmoHybridGatedDeltaNet": _DELTANET_LATER,
    "LaraMiniGatedDeltaNet": _DELTANET_LATER,
    "Qwen4ExpTextGatedDeltaNet": _DELTANET_LATER,
    "MiniMaxLightningAttention": "lightning (linear) attention over the sequence: no head-parallel adapter yet",
    "Lfm2ShortConv": "a short convolution over the sequence: no adapter yet",
    "RecurrentGemmaRecurrentBlock": "an RG-LRU recurrence over the sequence: no adapter yet",
}
# Layer kinds (a text config's `layer_types`) that mix tokens without the attention registry.
NON_ATTENTION_TAGS = ("linear", "mamba", "conv", "recurrent", "ssm", "deltanet", "hybrid")


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return decoder if isinstance(decoder, torch.nn.Module) else model


def _text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The `(name, module)` of every token mixer with a head-parallel adapter, in model order."""
    return [(n, m) for n, m in _decoder(model).named_modules() if type(m).__name__ in ADAPTERS]


def _refuse(model: torch.nn.Module, what: str, reason: str) -> ValueError:
    return ValueError(
        f"{type(model).__name__} mixes tokens outside attention: {what}, {reason}. Under sequence parallelism "
        "that layer would see only this rank's shard and the loss would be wrong. hf_longctx shards softmax "
        f"attention and these linear-attention layers: {sorted(ADAPTERS)}. Train this model with sp_size=1."
    )


def _layer_type(model: torch.nn.Module, name: str) -> str:
    # " (layer type 'linear_attention')" for a module under decoder.layers.<i>, when the config names types.
    parts = name.split(".")
    kinds = getattr(_text_config(model), "layer_types", None) or []
    if len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < len(kinds):
        return f" (layer type {kinds[int(parts[1])]!r})"
    return ""


def check_token_mixers(model: torch.nn.Module, sp_size: int = 1) -> None:
    """Refuse models that mix tokens in a way SP cannot shard exactly, before any step runs.

    Supported: softmax attention (through transformers' attention interface) and the layer classes of
    `ADAPTERS`, when their heads divide by `sp_size`. Everything else that mixes tokens (a known
    mixer class, any other module owning a `Conv1d`, or a non-attention `layer_types` entry whose
    layer holds no supported mixer) is refused by name.

    Raises:
        ValueError: naming the layer, its class or type, the reason and the fix.
    """
    decoder = _decoder(model)
    supported: list[str] = []
    for name, module in decoder.named_modules():
        kind = type(module).__name__
        if kind in ADAPTERS:
            ADAPTERS[kind].check_heads(module, name, sp_size)
            supported.append(name)
        elif kind in REFUSED:
            raise _refuse(model, f"{name}{_layer_type(model, name)} is {kind}", REFUSED[kind])
    for name, module in decoder.named_modules():
        inside = any(name == s or name.startswith(f"{s}.") for s in supported)
        if isinstance(module, torch.nn.Conv1d) and not inside:
            what = f"a Conv1d over the sequence ({name}){_layer_type(model, name)}"
            raise _refuse(model, what, "which has no head-parallel adapter")
    kinds = getattr(_text_config(model), "layer_types", None) or []
    layers = getattr(decoder, "layers", None)
    for index, kind in enumerate(kinds):
        if not isinstance(kind, str) or not any(tag in kind.lower() for tag in NON_ATTENTION_TAGS):
            continue
        layer = layers[index] if isinstance(layers, torch.nn.ModuleList) and index < len(layers) else None
        if layer is None or not any(type(m).__name__ in ADAPTERS for m in layer.modules()):
            held = f" ({type(layer).__name__})" if layer is not None else ""
            raise _refuse(model, f"layer {index}{held} of type {kind!r}", "which holds no supported mixer")


def attach_linear_layers(
    model: torch.nn.Module,
    groups: SequenceParallelGroups,
    layout: str,
    context_of: Callable[[dict[str, Any]], SequenceContext],
    on_call: Callable[[], None],
) -> list[Patch]:
    """Replace every supported linear-attention layer's `forward` by its head-parallel version.

    Returns:
        The applied patches; `patch.remove()` restores each layer exactly (the instance attribute goes).
    """
    patches = []
    try:
        for _, module in linear_layers(model):
            adapter = ADAPTERS[type(module).__name__]
            forward = adapter.head_parallel_forward(module, groups, layout, context_of, on_call)
            patch = Patch(module, "forward", lambda original, f=forward: f)
            patch.apply()
            patches.append(patch)
    except Exception:
        for patch in reversed(patches):
            patch.remove()
        raise
    return patches

"""Head-parallel Gated DeltaNet (Qwen3-Next, Qwen3.5): sequence shards -> key-head shards -> the layer's own code.

In the layer's forward only the short causal convolution and the chunked gated delta rule mix tokens;
the input projections, beta and the decay, the per-head gated RMSNorm and `out_proj` are token-local.
So, the same shape as Ulysses attention: each rank projects its own tokens and groups them by key head
(q, k, v, z, b, a of each key head and the value heads it serves: `LAYOUTS`), one all-to-all hands every
rank whole key-head groups for the FULL sequence, the layer's own forward runs on `_LocalHeads` (a view
with the local head counts, `in_proj_*` reading the exchanged groups back, and the matching slices of
`conv1d`, `A_log` and `dt_bias`: its own convolution and kernel, FLA where installed, the torch fallback
otherwise), and one all-to-all brings the per-head outputs back to the sequence shards before `out_proj`.

Packed rows: every document starts with a fresh convolution and recurrent state (the layer runs once
per document, boundaries from the global `position_ids`), as upstream's FLA kernels do with
`cu_seqlens`. Upstream's torch fallback, given only `position_ids`, carries the state across documents.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.attention.kernels import SequenceContext
from hf_longctx.data.layout import gathered_order, to_global_order
from hf_longctx.distributed.comm import all_to_all
from hf_longctx.distributed.groups import SequenceParallelGroups

Projections = dict[str, Callable[[torch.Tensor], torch.Tensor]]


def _pack_qwen3_next(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # in_proj_qkvz / in_proj_ba are laid out key head by key head already.
    nk = module.num_k_heads
    qkvz, ba = module.in_proj_qkvz(hidden).unflatten(-1, (nk, -1)), module.in_proj_ba(hidden).unflatten(-1, (nk, -1))
    return torch.cat([qkvz, ba], dim=-1)


def _unpack_qwen3_next(module: torch.nn.Module) -> Projections:
    width = 2 * module.head_k_dim + 2 * module.head_v_dim * (module.num_v_heads // module.num_k_heads)
    return {"in_proj_qkvz": lambda x: x[..., :width].flatten(2), "in_proj_ba": lambda x: x[..., width:].flatten(2)}


def _widths_qwen3_5(module: torch.nn.Module) -> list[int]:
    ratio = module.num_v_heads // module.num_k_heads  # value heads per key head
    return [module.head_k_dim, module.head_k_dim, ratio * module.head_v_dim, ratio * module.head_v_dim, ratio, ratio]


def _pack_qwen3_5(module: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # in_proj_qkv is [q of all key heads | k | v of all value heads]: regroup it (and z, b, a) per key head.
    nk = module.num_k_heads
    q, k, v = module.in_proj_qkv(hidden).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    parts = (q, k, v, module.in_proj_z(hidden), module.in_proj_b(hidden), module.in_proj_a(hidden))
    return torch.cat([p.unflatten(-1, (nk, -1)) for p in parts], dim=-1)


def _unpack_qwen3_5(module: torch.nn.Module) -> Projections:
    widths = _widths_qwen3_5(module)

    def part(x: torch.Tensor, i: int) -> torch.Tensor:
        return x[..., sum(widths[:i]) : sum(widths[: i + 1])].flatten(2)

    return {
        "in_proj_qkv": lambda x: torch.cat([part(x, 0), part(x, 1), part(x, 2)], dim=-1),
        "in_proj_z": lambda x: part(x, 3),
        "in_proj_b": lambda x: part(x, 4),
        "in_proj_a": lambda x: part(x, 5),
    }


# Class name -> (pack a shard's projections as [bs, sl_l, nk, w], the view's in_proj_* reading them back).
LAYOUTS = {
    "Qwen3NextGatedDeltaNet": (_pack_qwen3_next, _unpack_qwen3_next),
    "Qwen3_5GatedDeltaNet": (_pack_qwen3_5, _unpack_qwen3_5),
    "Qwen3_5MoeGatedDeltaNet": (_pack_qwen3_5, _unpack_qwen3_5),
}


def valid_sp_sizes(module: torch.nn.Module) -> list[int]:
    """SP sizes that split the layer's key and value heads evenly."""
    nk, nv = module.num_k_heads, module.num_v_heads
    return [p for p in range(1, nk + 1) if nk % p == 0 and nv % p == 0]


def check_heads(module: torch.nn.Module, name: str, sp_size: int) -> None:
    """Raise a `ValueError` naming the SP sizes that work when the heads do not split over `sp_size`."""
    nk, nv = module.num_k_heads, module.num_v_heads
    if nk % sp_size or nv % sp_size:
        raise ValueError(
            f"{type(module).__name__} ({name}) has linear_num_key_heads={nk} and linear_num_value_heads={nv}: "
            f"head-parallel linear attention needs both divisible by sp_size={sp_size}. sp_size values that "
            f"work for this model: {valid_sp_sizes(module)} (every sp_backend shards these layers by heads; "
            "ring, hybrid and auto change only the softmax attention layers)."
        )


class _Conv1dSlice:
    """The `.weight` / `.bias` of the depthwise `conv1d` restricted to this rank's q, k and v channels."""

    def __init__(self, conv: torch.nn.Conv1d, ranges: list[tuple[int, int]]) -> None:
        self.weight = torch.cat([conv.weight[a:b] for a, b in ranges])
        self.bias = None if conv.bias is None else torch.cat([conv.bias[a:b] for a, b in ranges])


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class _LocalHeads:
    """`module` as its own forward must see it on one rank: key heads `[r * nk_l, (r + 1) * nk_l)`.

    The projections are already done: the forward's `hidden_states` is the exchanged `[bs, sl, nk_l, w]`
    tensor (flattened to 3-D), which the view's `in_proj_*` split again (`LAYOUTS`); `out_proj` is left
    to the caller (after the exchange back). `conv1d`, `A_log` and `dt_bias` are differentiable slices of
    the real parameters; the rest (norm, head dims, activation, methods) is the module's own.
    """

    def __init__(self, module: torch.nn.Module, rank: int, sp_size: int) -> None:
        self._module = module
        self.num_k_heads, self.num_v_heads = module.num_k_heads // sp_size, module.num_v_heads // sp_size
        self.key_dim, self.value_dim = self.num_k_heads * module.head_k_dim, self.num_v_heads * module.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        # conv channels: [q of all key heads | k of all key heads | v of all value heads]
        k0, v0, full_k = rank * self.key_dim, rank * self.value_dim, module.key_dim
        ranges = [(k0, k0 + self.key_dim), (full_k + k0, full_k + k0 + self.key_dim)]
        ranges.append((2 * full_k + v0, 2 * full_k + v0 + self.value_dim))
        self.conv1d = _Conv1dSlice(module.conv1d, ranges)
        heads = slice(rank * self.num_v_heads, (rank + 1) * self.num_v_heads)
        self.A_log, self.dt_bias = module.A_log[heads], module.dt_bias[heads]
        for name, read in LAYOUTS[type(module).__name__][1](module).items():
            # forward passes the flattened [bs, sl, nk_l * w] on; regroup it per key head first
            setattr(self, name, lambda x, read=read: read(x.unflatten(-1, (self.num_k_heads, -1))))
        self.out_proj = _identity

    def __getattr__(self, name: str) -> Any:
        attribute = inspect.getattr_static(type(self._module), name, None)
        if isinstance(attribute, types.FunctionType):
            return attribute.__get__(self)  # the class's methods read this view's head counts
        return getattr(self._module, name)

    def run(self, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """`[bs, sl, nk_l, w]` exchanged projections -> `[bs, sl, nv_l * head_v_dim]` gated-norm output."""
        forward = type(self._module).forward
        return forward(self, hidden_states=x.flatten(2), cache=None, attention_mask=None, **kwargs)


def _check_no_cached_state(module: torch.nn.Module, cache: Any) -> None:
    # A fresh cache (a training forward with use_cache=True) is left unfilled for this layer; a cache that
    # already holds this layer's state is a continuation (generation), which SP does not shard.
    if cache is None:
        return
    index = module.layer_idx
    has_state = getattr(cache, "has_previous_state", None)
    if callable(has_state) and has_state(index):
        raise ValueError(
            f"{type(module).__name__} (layer {index}) got a cache holding its previous state: sequence "
            "parallelism shards training forwards, not cached generation. Call the model with use_cache=False "
            "or remove the SP handle (handle.remove()) before generating."
        )


def _segments(x: torch.Tensor, view: _LocalHeads, context: SequenceContext, kwargs: dict[str, Any]) -> torch.Tensor:
    """Run `view` once per document of each row (state starts fresh at every document)."""
    if context.single_document:
        return view.run(x, kwargs)
    rows = []
    for b, segments in enumerate(context.segments()):
        rows.append(torch.cat([view.run(x[b : b + 1, s:e], kwargs) for s, e in segments], dim=1))
    return torch.cat(rows, dim=0)


def head_parallel_forward(
    module: torch.nn.Module,
    groups: SequenceParallelGroups,
    layout: str,
    context_of: Callable[[dict[str, Any]], SequenceContext],
    on_call: Callable[[], None],
) -> Callable[..., torch.Tensor]:
    """The replacement `module.forward` (same signature) for one Gated DeltaNet layer (`LAYOUTS`) under SP.

    Args:
        module: the layer; its key and value heads must divide by the SP size (`check_heads`).
        groups: the exchange runs over `groups.sp_group`.
        layout: the token layout of the shards ("contiguous" or "zigzag", see `data/layout.py`).
        context_of: pops this forward's `SequenceContext` out of the layer's kwargs.
        on_call: called once per layer call (the handle counts token mixers, see `registry._check_layers`).
    """
    ws, rank, group = groups.sp_world_size, groups.sp_rank, groups.sp_group
    pack = LAYOUTS[type(module).__name__][0]

    def forward(
        hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        context = context_of(kwargs)
        on_call()
        _check_no_cached_state(module, cache)
        if context is None:  # a single-process handle left this forward (left padding) to the model
            raise ValueError(
                "hf_longctx's linear-attention layers take right-padded or packed rows; remove the handle "
                "(handle.remove()) to run this model on left-padded ones."
            )
        bs, sl_l, _ = hidden_states.shape
        if context.position_ids.shape != (bs, sl_l * ws):
            raise ValueError(
                f"Local shard [bs={bs}, seq={sl_l}] x sp={ws} does not match the global position_ids "
                f"{tuple(context.position_ids.shape)}: build the batch with hf_longctx.shard_batch."
            )
        if attention_mask is not None and attention_mask.dim() == 2:
            # Padding tokens enter the projections as zeros (upstream's padding rule, token-local).
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        x = pack(module, hidden_states)  # [bs, sl_l, nk, w]: one collective for every projection
        x = to_global_order(all_to_all(x, scatter_dim=2, gather_dim=1, group=group), layout, ws)  # [bs, sl, nk_l, w]
        out = _segments(x, _LocalHeads(module, rank, ws), context, kwargs)  # [bs, sl, nv_l * hv]
        if layout != "contiguous" and ws > 1:
            out = out.index_select(1, gathered_order(layout, ws, out.shape[1]).to(out.device))
        out = all_to_all(out, scatter_dim=1, gather_dim=2, group=group)  # [bs, sl_l, nv * hv]
        return module.out_proj(out)

    return forward

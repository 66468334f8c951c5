"""Ulysses attention: sequence-sharded q/k/v -> head-sharded full sequence -> model kernel -> back.

`ulysses_attention` is the main (pure) function; `attention/registry.py` plugs it into
transformers' attention registry. One all-to-all carries q, k and v together, and each rank
receives only the key/value heads its query heads use (GQA/MQA included).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from hf_longctx.attention.kernels import SequenceContext, attend, attention_chunk_size
from hf_longctx.distributed.comm import all_to_all
from hf_longctx.distributed.groups import SequenceParallelGroups


def valid_sp_sizes(num_heads: int) -> list[int]:
    """SP sizes Ulysses supports for a model with `num_heads` query heads."""
    return [p for p in range(1, num_heads + 1) if num_heads % p == 0]


def check_heads(num_heads: int, sp_size: int) -> None:
    """Raise a `ValueError` naming the SP sizes that work when `num_heads % sp_size != 0`."""
    if num_heads % sp_size != 0:
        raise ValueError(
            f"Ulysses needs num_attention_heads ({num_heads}) divisible by sp_size ({sp_size}); "
            f"valid sp_size values for this model: {valid_sp_sizes(num_heads)} (sp_backend='ring', 'hybrid' or "
            "'auto' work at any sp_size)."
        )


@dataclass(frozen=True)
class HeadLayout:
    """Which heads each rank computes after the all-to-all.

    Rank r owns query heads `[r * q_local, (r + 1) * q_local)`. `kv_index` lists, destination by
    destination, the key/value heads to send (`kv_local` per rank); `None` means a plain split.
    """

    q_local: int
    kv_local: int
    kv_groups_local: int  # query heads per key/value head on each rank
    kv_index: tuple[int, ...] | None


@lru_cache(maxsize=64)
def head_layout(num_heads: int, num_kv_heads: int, sp_size: int) -> HeadLayout:
    """Plan the head exchange for `num_heads` query and `num_kv_heads` key/value heads on `sp_size` ranks.

    Raises:
        ValueError: heads not divisible by `sp_size`, or query heads not a multiple of kv heads.
    """
    check_heads(num_heads, sp_size)
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})."
        )
    q_local, group = num_heads // sp_size, num_heads // num_kv_heads
    if num_kv_heads % sp_size == 0:
        # Every rank gets its own contiguous block of kv heads: no copy needed.
        return HeadLayout(q_local, num_kv_heads // sp_size, group, None)
    if group % q_local == 0:
        # A rank's query heads all read one kv head (MQA, or kv heads < sp_size): send it alone.
        index = tuple(r * q_local // group for r in range(sp_size))
        return HeadLayout(q_local, 1, q_local, index)
    # Irregular split: give every local query head its own copy of its kv head.
    index = tuple(h // group for h in range(num_heads))
    return HeadLayout(q_local, q_local, 1, index)


@lru_cache(maxsize=256)
def head_index(index: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`index` as a tensor on `device`, built once per layout and device, not once per layer call (a
    host-to-device copy on GPU)."""
    return torch.tensor(index, device=device)


# Per-query-head tensors that kernels read from the attention module or receive as keyword arguments:
# learnable attention sinks (GPT-OSS: `module.sinks` in eager, `s_aux=` for flash and flex).
PER_HEAD_ATTRS = ("sinks",)
PER_HEAD_KWARGS = ("s_aux", "sinks")


class _KernelModuleView:
    """The attention module as the local kernel must see it: local heads, original kernel name.

    Kernels read `module.num_key_value_groups` (GQA expansion), per-head tensors such as
    `module.sinks`, and flash reads `module.config._attn_implementation`; all differ on the
    full-sequence/local-heads side, and a view avoids mutating the real module or the shared config.
    """

    def __init__(
        self, module: torch.nn.Module, kv_groups: int, kernel_name: str, heads: slice, attrs: dict[str, Any]
    ) -> None:
        self._module = module
        self._heads = heads
        self._attrs = attrs  # attributes read from here instead of the module (see `KernelCall.attrs`)
        self.num_key_value_groups = kv_groups
        self.config = _ConfigView(module.config, kernel_name) if hasattr(module, "config") else None

    def __getattr__(self, name: str) -> Any:
        value = self._attrs[name] if name in self._attrs else getattr(self._module, name)
        if name in PER_HEAD_ATTRS and isinstance(value, torch.Tensor):
            return value[self._heads]  # a differentiable slice: this rank's heads only
        return value


class _ConfigView:
    def __init__(self, config: Any, kernel_name: str) -> None:
        self._config = config
        self._attn_implementation = kernel_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def exchange_qkv(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: HeadLayout, groups: SequenceParallelGroups
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence-sharded `[bs, hc, sl_l, hs]` q/k/v -> head-sharded `[bs, hc_l, sl, hs]`.

    A tensor may also come split per destination, `[bs, ws, heads per rank, sl_l, hs]` (head chunks pass
    views of the model's q/k/v so: the send buffer is then their only copy).
    """
    ws, group = groups.sp_world_size, groups.sp_group
    if ws == 1 and layout.kv_index is None and query.dim() == key.dim() == value.dim() == 4:
        return query, key, value  # one rank (sp_size=1): nothing to exchange, and no packed q/k/v copy
    if layout.kv_index is not None:
        index = head_index(layout.kv_index, key.device)
        key, value = key.index_select(1, index), value.index_select(1, index)
    split = [t if t.dim() == 5 else t.unflatten(1, (ws, -1)) for t in (query, key, value)]
    if query.shape[-1] == key.shape[-1] == value.shape[-1]:
        # One collective: per destination, [q heads | k heads | v heads] side by side. The cat writes the
        # send buffer rank-major, so the all-to-all sends it without another copy for any batch size.
        # [ws, bs, hc_l + 2 * kv_l, sl_l, hs]
        qkv = torch.cat([t.movedim(1, 0) for t in split], dim=2)
        qkv = all_to_all(qkv, scatter_dim=0, gather_dim=3, group=group)[0]  # [bs, hc_l + 2 * kv_l, sl, hs]
        return qkv.split([layout.q_local, layout.kv_local, layout.kv_local], dim=1)
    # Head dims differ (e.g. MLA): three collectives.
    return tuple(all_to_all(t.flatten(1, 2), scatter_dim=1, gather_dim=2, group=group) for t in split)


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    kernel: Callable[..., tuple[torch.Tensor, Any]],
    kernel_name: str,
    family: str,
    context: SequenceContext,
    groups: SequenceParallelGroups,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the full sequence for a rank that holds one sequence shard.

    Args:
        module: the model's attention module (read by the kernel).
        query: `[bs, hc, sl_l, hs]` local queries (RoPE applied with global positions).
        key: `[bs, hc_kv, sl_l, hs]` local keys.
        value: `[bs, hc_kv, sl_l, hs_v]` local values.
        kernel: the model's own attention function (sdpa, eager, flash, flex).
        kernel_name: its name in transformers' registry (flash branches on it).
        family: the kernel family, see `kernels.kernel_family`.
        context: global sequence metadata of this forward.
        groups: SP groups; the exchange runs over `groups.sp_group`.
        **kwargs: what the model passed to the attention function (dropout, scaling, ...).

    Returns:
        `([bs, sl_l, hc, hs_v], None)`: the layout transformers expects from attention functions.

    Raises:
        ValueError: head counts incompatible with the SP size, or the shard length does not
            match the forward's global sequence.
    """
    check_shard(query, context, groups.sp_world_size)
    layout = head_layout(query.shape[1], key.shape[1], groups.sp_world_size)
    call = KernelCall(module, kernel, kernel_name, family, context, groups, kwargs)
    return attend_local_heads(call, query, key, value, layout, groups.sp_rank * layout.q_local), None


def check_shard(query: torch.Tensor, context: SequenceContext, sp_size: int) -> None:
    """Raise a `ValueError` when the `[bs, hc, sl_l, hs]` shard does not match the forward's global sequence."""
    bs, _, sl_l, _ = query.shape
    if context.position_ids.shape != (bs, sl_l * sp_size):
        raise ValueError(
            f"Local shard [bs={bs}, seq={sl_l}] x sp={sp_size} does not match the global position_ids "
            f"{tuple(context.position_ids.shape)}: build the batch with hf_longctx.shard_batch."
        )


@dataclass(frozen=True)
class KernelCall:
    """One attention call's kernel and what it needs besides q/k/v (see `ulysses_attention`'s arguments).

    `attrs` replaces module attributes the kernel reads (a recompute passes its own copies of the sinks).
    """

    module: torch.nn.Module
    kernel: Callable[..., tuple[torch.Tensor, Any]]
    kernel_name: str
    family: str
    context: SequenceContext
    groups: SequenceParallelGroups
    kwargs: dict[str, Any]
    attrs: dict[str, Any] = field(default_factory=dict)


def sdpa_takes_grouped_kv(q: torch.Tensor) -> bool:
    """Whether SDPA runs grouped K/V (`enable_gqa`, what transformers passes when there is no mask) for `q` without
    its math kernel, which holds [S, S] scores per document. On CUDA only its flash kernel takes them (fp16/bf16;
    torch.nn.functional.scaled_dot_product_attention's docs: GQA "works only for Flash_attention and math kernel on
    CUDA"), so fp32 gets expanded K/V, which the memory-efficient kernel takes; the CPU flash kernel takes them."""
    return not q.is_cuda or q.dtype in (torch.float16, torch.bfloat16)


def attend_local_heads(
    call: KernelCall,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: HeadLayout,
    first_head: int,
) -> torch.Tensor:
    """Exchange, the kernel over the full sequence on this rank's `layout.q_local` heads, exchange back.

    Args:
        call: the kernel and its inputs.
        query, key, value: sequence-sharded, the heads to exchange in the order `layout` sends them.
        layout: what each rank receives (`kv_index=None`: a plain split of `key` / `value`).
        first_head: the model's index of this rank's first query head (per-head tensors such as sinks
            are sliced from there).

    Returns:
        `[bs, sl_l, ws * q_local, hs_v]`, heads in the order `query` sent them.
    """
    q, k, v = exchange_qkv(query, key, value, layout, call.groups)
    heads = slice(first_head, first_head + layout.q_local)
    kwargs = dict(call.kwargs)
    for name in PER_HEAD_KWARGS:
        if isinstance(kwargs.get(name), torch.Tensor):
            kwargs[name] = kwargs[name][heads]
    kv_groups = layout.kv_groups_local
    if call.family == "sdpa" and kv_groups > 1 and not sdpa_takes_grouped_kv(q):
        k, v = (t.repeat_interleave(kv_groups, dim=1) for t in (k, v))  # O(S) memory, for the efficient kernel
        kv_groups = 1
    view = _KernelModuleView(call.module, kv_groups, call.kernel_name, heads, call.attrs)
    # [bs, sl, hc_l, hs_v]; sdpa / eager run per document (or block), never with a [sl, sl] mask
    out = attend(call.kernel, view, call.family, call.context, q, k, v, kwargs, attention_chunk_size(call.module))
    return all_to_all(out, scatter_dim=1, gather_dim=2, group=call.groups.sp_group)  # [bs, sl_l, ws * hc_l, hs_v]

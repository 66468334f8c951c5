"""What each local attention kernel needs to see the full sequence exactly, in memory linear in it.

`SequenceContext` is built once per model forward from the all-gathered global `position_ids`
and lazily derives, per kernel family, the varlen `cu_seq_lens_*` (flash-attn), the `BlockMask`
(flex, built block by block) or the segments (documents, cut at chunk boundaries for chunked
layers) that sdpa and eager run on (`local.attend_blocks`). `attend` is the main entry used by
the Ulysses wrapper. Packed documents never attend to each other on any kernel, and no kernel
gets a dense `[sl, sl]` mask: sdpa and eager run once per segment (causal, no mask), a sliding
window as a band of query blocks against the keys of their window (`blocks.plan_segment`), and
eager, which has no causal flag, in query blocks with `[q_block, keys]` masks. Attention then
costs the sum of squared segment lengths (O(S x W) with a window) instead of the square of the row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_longctx.attention.local import attend_blocks
from hf_longctx.data.sharding import document_starts

FLASH_KERNELS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
SUPPORTED_KERNELS = ("sdpa", "eager", "flex_attention", *FLASH_KERNELS)
_PADDING_FREE_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def kernel_family(name: str) -> str:
    """Map an attention implementation name to "sdpa", "eager", "flash" or "flex"."""
    if name in ("sdpa", "eager"):
        return name
    if name == "flex_attention":
        return "flex"
    if name in FLASH_KERNELS or "flash" in name:  # hub kernels, e.g. "kernels-community/flash-attn3"
        return "flash"
    raise ValueError(
        f"attn_implementation={name!r} is not supported under sequence parallelism; "
        f"load the model with one of {list(SUPPORTED_KERNELS)}."
    )


@dataclass
class SequenceContext:
    """Global sequence metadata of one forward pass, shared by every attention layer."""

    position_ids: torch.Tensor  # [bs, sl] global positions
    single_document: bool = field(init=False)  # every row holds one document: plain causal
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.single_document = bool(document_starts(self.position_ids)[:, 1:].sum() == 0)

    @property
    def doc_ids(self) -> torch.Tensor:
        """`[bs, sl]` document index within each row (from 1): the ring's block plans compare them."""
        if "doc_ids" not in self._cache:
            self._cache["doc_ids"] = document_starts(self.position_ids).cumsum(dim=1)
        return self._cache["doc_ids"]

    def segment_starts(self, chunk: int | None = None) -> torch.Tensor:
        """`[bs, sl]` True where a segment starts: documents, cut further at every multiple of
        `chunk` positions for chunked-attention layers (transformers' chunked masks)."""
        starts = document_starts(self.position_ids)
        return starts | (self.position_ids % chunk == 0) if chunk is not None else starts

    def segments(self, chunk: int | None = None) -> list[list[tuple[int, int]]]:
        """Per row, the `[start, end)` token ranges that attend only among themselves."""
        key = ("segments", chunk)
        if key not in self._cache:
            starts = self.segment_starts(chunk)
            sl, rows = starts.shape[1], []
            for row in starts:
                bounds = torch.nonzero(row).flatten().tolist() + [sl]
                rows.append(list(zip(bounds[:-1], bounds[1:], strict=True)))
            self._cache[key] = rows
        return self._cache[key]

    def varlen_kwargs(self, chunk: int | None = None) -> dict[str, Any]:
        """`cu_seq_lens_q/k` and `max_length_q/k` over the flattened batch (flash varlen); with
        `chunk`, every chunk of positions is its own segment."""
        key = ("varlen", chunk)
        if key not in self._cache:
            starts = self.segment_starts(chunk).flatten()
            total = starts.numel()
            bounds = torch.nonzero(starts).flatten()
            cu = torch.cat([bounds, bounds.new_tensor([total])]).to(torch.int32)
            max_len = int(cu.diff().max().item())
            self._cache[key] = {
                "cu_seq_lens_q": cu,
                "cu_seq_lens_k": cu,
                "max_length_q": max_len,
                "max_length_k": max_len,
            }
        return self._cache[key]

    def block_mask(self, sliding_window: int | None, chunk: int | None = None):
        """A flex-attention `BlockMask`: causal, same segment, within the window; built from
        segment boundaries block by block (`block_mask.segment_block_mask`), never from a dense
        `[sl, sl]` mask as `create_block_mask` would."""
        key = ("block", sliding_window, chunk)
        if key not in self._cache:
            from hf_longctx.attention.block_mask import segment_block_mask

            segment_ids = self.segment_starts(chunk).cumsum(dim=1)
            self._cache[key] = segment_block_mask(segment_ids, sliding_window)
        return self._cache[key]


def attention_chunk_size(module: Any) -> int | None:
    """The chunk size if `module` is a chunked-attention layer (Llama 4: `layer_types[i] ==
    "chunked_attention"`, `attention_chunk_size`), else None. Such layers get their mask from the
    layer type, not from a keyword argument, so it is read from the module's config."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if layer is None or not isinstance(types, (list, tuple)) or layer >= len(types):
        return None
    return getattr(config, "attention_chunk_size", None) if types[layer] == "chunked_attention" else None


def kernel_inputs(
    family: str, context: SequenceContext, kwargs: dict[str, Any], chunk: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """The `attention_mask` and keyword arguments to call a flash or flex kernel on the full sequence.

    Args:
        family: "flash" or "flex" (sdpa and eager run block by block, see `attend`).
        context: the forward's global sequence metadata.
        kwargs: the keyword arguments the model passed to the attention function.
        chunk: the layer's attention chunk size (see `attention_chunk_size`), or None.

    Returns:
        `(attention_mask, kwargs)` for the kernel; local padding-free metadata is replaced by
        global metadata and `position_ids` by the global positions.

    Raises:
        ValueError: `family` is "sdpa" or "eager".
    """
    if family not in ("flash", "flex"):
        raise ValueError(f"kernel_inputs serves flash and flex kernels; {family!r} runs through attend().")
    kw = {k: v for k, v in kwargs.items() if k not in _PADDING_FREE_KWARGS}
    kw["position_ids"] = context.position_ids
    if family == "flash":
        if not context.single_document or chunk is not None:
            kw.update(context.varlen_kwargs(chunk))
        return None, kw
    return context.block_mask(kw.get("sliding_window"), chunk), kw


def attend(
    kernel: Callable[..., tuple[torch.Tensor, Any]],
    module: Any,
    family: str,
    context: SequenceContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
    chunk: int | None = None,
) -> torch.Tensor:
    """Run `kernel` over the full sequence with the document / window / chunk rule of `context`.

    Args:
        kernel: the model's attention function (transformers' signature).
        module: what the kernel reads as its module (local head counts).
        family: see `kernel_family`.
        context: the forward's global sequence metadata.
        query: `[bs, hc_l, sl, hs]`; key / value: `[bs, hc_kv_l, sl, hs(_v)]`.
        kwargs: the keyword arguments the model passed to the attention function.
        chunk: the layer's attention chunk size, or None.

    Returns:
        `[bs, sl, hc_l, hs_v]`, the kernel's output layout.
    """
    if family in ("flash", "flex"):
        mask, kw = kernel_inputs(family, context, kwargs, chunk)
        return kernel(module, query, key, value, mask, **kw)[0]
    kw = {k: v for k, v in kwargs.items() if k not in _PADDING_FREE_KWARGS and k != "position_ids"}
    window = kw.get("sliding_window")
    unbound = window is None or window >= query.shape[2]
    if context.single_document and chunk is None and unbound and family != "eager":
        # One document per row and no binding window: one causal call, no segments (no host round trip per layer:
        # torch.compile traces through).
        return kernel(module, query, key, value, None, **kw)[0]
    return attend_blocks(kernel, module, family, context.segments(chunk), query, key, value, kw, window)

"""What each local attention kernel needs to see the full sequence exactly.

`SequenceContext` is built once per model forward from the all-gathered global `position_ids`
and lazily derives, per kernel family, the document-causal mask (sdpa, eager), the varlen
`cu_seq_lens_*` (flash-attn) or the `BlockMask` (flex). Packed documents therefore never attend
to each other, on every kernel. `kernel_inputs` is the main entry used by the Ulysses wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.sharding import document_starts

FLASH_KERNELS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
SUPPORTED_KERNELS = ("sdpa", "eager", "flex_attention", *FLASH_KERNELS)


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
    doc_ids: torch.Tensor = field(init=False)  # [bs, sl] document index within each row
    single_document: bool = field(init=False)  # every row holds one document: plain causal
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        starts = document_starts(self.position_ids)
        self.doc_ids = starts.cumsum(dim=1)
        self.single_document = bool((self.doc_ids[:, -1] == 1).all())

    def allowed(self, sliding_window: int | None, chunk: int | None = None) -> torch.Tensor:
        """Boolean `[bs, 1, sl, sl]`: query i may attend key j (causal, same document, in window,
        and with `chunk` in the same chunk of positions, as transformers' chunked attention)."""
        key = ("allowed", sliding_window, chunk)
        if key not in self._cache:
            sl = self.position_ids.shape[1]
            idx = torch.arange(sl, device=self.position_ids.device)
            ok = (idx[:, None] >= idx[None, :]).unsqueeze(0)
            ok = ok & (self.doc_ids[:, :, None] == self.doc_ids[:, None, :])
            if sliding_window is not None:
                ok = ok & ((idx[:, None] - idx[None, :]) < sliding_window).unsqueeze(0)
            if chunk is not None:
                block = self.position_ids // chunk
                ok = ok & (block[:, :, None] == block[:, None, :])
            self._cache[key] = ok.unsqueeze(1)
        return self._cache[key]

    def additive_mask(self, dtype: torch.dtype, sliding_window: int | None, chunk: int | None = None) -> torch.Tensor:
        """Float `[bs, 1, sl, sl]` mask: 0 where allowed, the dtype's minimum elsewhere (eager)."""
        key = ("additive", dtype, sliding_window, chunk)
        if key not in self._cache:
            allowed = self.allowed(sliding_window, chunk)
            zero = torch.zeros((), dtype=dtype, device=allowed.device)
            self._cache[key] = torch.where(allowed, zero, torch.finfo(dtype).min)
        return self._cache[key]

    def varlen_kwargs(self, chunk: int | None = None) -> dict[str, Any]:
        """`cu_seq_lens_q/k` and `max_length_q/k` over the flattened batch (flash varlen); with
        `chunk`, every chunk of positions is its own segment."""
        key = ("varlen", chunk)
        if key not in self._cache:
            starts = document_starts(self.position_ids)
            if chunk is not None:
                starts = starts | (self.position_ids % chunk == 0)
            starts = starts.flatten()
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
        """A flex-attention `BlockMask` with the same rule as `allowed`."""
        key = ("block", sliding_window, chunk)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            doc, pos = self.doc_ids, self.position_ids

            def mask_mod(b, h, q_idx, kv_idx):
                ok = (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])
                if sliding_window is not None:
                    ok = ok & (q_idx - kv_idx < sliding_window)
                if chunk is not None:
                    ok = ok & (pos[b, q_idx] // chunk == pos[b, kv_idx] // chunk)
                return ok

            bs, sl = doc.shape
            self._cache[key] = create_block_mask(mask_mod, bs, None, sl, sl, device=doc.device)
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
    family: str, context: SequenceContext, query: torch.Tensor, kwargs: dict[str, Any], chunk: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """The `attention_mask` and keyword arguments to call a kernel of `family` on the full sequence.

    Args:
        family: "sdpa", "eager", "flash" or "flex" (see `kernel_family`).
        context: the forward's global sequence metadata.
        query: the full-sequence query `[bs, hc_l, sl, hs]` (for dtype and head count).
        kwargs: the keyword arguments the model passed to the attention function.
        chunk: the layer's attention chunk size (see `attention_chunk_size`), or None.

    Returns:
        `(attention_mask, kwargs)` for the kernel; local padding-free metadata is replaced by
        global metadata and `position_ids` by the global positions.
    """
    kw = {
        k: v for k, v in kwargs.items() if k not in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    }
    kw["position_ids"] = context.position_ids
    window = kw.get("sliding_window")
    if family == "sdpa":
        needs_mask = not context.single_document or window is not None or chunk is not None
        return (context.allowed(window, chunk) if needs_mask else None), kw
    if family == "eager":
        return context.additive_mask(query.dtype, window, chunk), kw
    if family == "flash":
        if not context.single_document or chunk is not None:
            kw.update(context.varlen_kwargs(chunk))
        return None, kw
    return context.block_mask(window, chunk), kw

"""Which attention kernel a planned run uses (`attention_kernel`), and the kernel facts its memory terms depend on.

The kernel follows `--attn`, the device and the dtype as hf_longctx picks it (attention/lse/choose.py and
attention/kernels.py): on a GPU in bf16, `flash` is the flash-attn package and `sdpa` is torch's own
FlashAttention-2 (sdpa's flash backend per document; `aten._flash_attention_*` for tiled_layer's tiles); both keep
an fp32 dq accumulator and expand dk/dv to every query head under GQA in their backward (`flash2_backward`). In
fp32 sdpa runs torch's memory-efficient kernel; on the CPU torch's CPU flash kernel. Sliding-window layers on sdpa /
eager run as a band of masked query blocks (attention/blocks.py; on a GPU sdpa's masked path is the memory-efficient
kernel), on flash-attn with its window argument; chunked layers per chunk. Torch-free: the planner runs without
torch.
"""

from __future__ import annotations

from hf_longctx.attention.blocks import band_rows
from hf_longctx.planner.model_shape import ModelShape
from hf_longctx.planner.run import RunConfig


def flash2_backward(run: RunConfig, on_cpu: bool) -> bool:
    """A FlashAttention-2 backward (flash-attn's or torch's): fp32 dq accumulator, GQA-expanded dk/dv."""
    return not on_cpu and run.dtype == "bf16" and run.attn in ("flash", "sdpa")


def keeps_transformers_mask(model: ModelShape, run: RunConfig) -> bool:
    """Without SP hf_longctx leaves this model's attention (and its mask) to transformers (`own_attention`)."""
    return run.sp == 1 and bool(model.own_attention)


def attention_kernel(model: ModelShape, run: RunConfig, on_cpu: bool) -> str:
    """The attention kernel the run uses, in words; per attention kind when the model mixes kinds."""
    if on_cpu:
        kernel = "torch's CPU flash kernel" if run.attn != "eager" else "eager"
    elif run.attn == "eager":
        kernel = "eager"
    elif run.attn == "flash":
        kernel = "flash-attn 2 (the flash-attn package; varlen for packed rows)"
    elif run.dtype == "bf16":
        kernel = "torch's FlashAttention-2 (sdpa's flash backend; no flash-attn)"
    else:
        kernel = "torch's memory-efficient kernel (sdpa, fp32)"
    if keeps_transformers_mask(model, run):
        return f"{kernel}, the model's own attention ({model.own_attention}: transformers builds its mask)"
    kinds = model.layer_kinds()
    parts = [f"{_KIND_NAMES.get(kind, kind)} ({count}): {_per_kind(model, run, on_cpu, kind, kernel)}"
             for kind, count in kinds.items()]  # fmt: skip
    return parts[0].split(": ", 1)[1] if len(kinds) == 1 and "full_attention" in kinds else "; ".join(parts)


_KIND_NAMES = {"full_attention": "full layers", "sliding_attention": "sliding-window layers",
               "chunked_attention": "chunked layers"}  # fmt: skip


def _per_kind(model: ModelShape, run: RunConfig, on_cpu: bool, kind: str, kernel: str) -> str:
    """How one kind of layer runs (attention/local.py, attention/blocks.py, memory/layer_match.py)."""
    if kind == "sliding_attention":
        window = model.sliding_window
        if run.attn == "flash":
            return f"{kernel} with its window argument (window {window}), no mask"
        rows = band_rows(window)
        band_kernel = kernel if on_cpu or run.attn == "eager" else "torch's memory-efficient kernel (sdpa, masked)"
        return (f"{band_kernel} in a band of {rows}-query blocks against {rows + window - 1} keys each (window "
                f"{window}; one [{rows}, {rows + window - 1}] mask, inner blocks batched)")  # fmt: skip
    if kind == "chunked_attention":
        how = "varlen segments" if run.attn == "flash" else "per chunk"
        return f"{kernel}, {how} of {model.attention_chunk} positions, no mask"
    if run.tiled_layer is not False:
        return f"{kernel}, per query tile against the whole sequence (tiled_layer), no mask"
    if run.attn == "eager":
        return "eager, per document in query blocks (masks of at most 2^22 elements)"
    return f"{kernel}, per document, no mask"

"""torch's own FlashAttention-2 on CUDA: dense and packed (varlen) blocks in fp16 / bf16, no flash-attn needed.

`TorchFlashOps` is the one adapter for the private ops `aten._flash_attention_forward` / `_flash_attention_backward`.
They are the op pair torch's public `torch.nn.attention.varlen.varlen_attn` calls (torch/nn/attention/varlen.py,
2.10-2.13), called here with the arguments that module passes. The public function is not used: no public entry
takes the caller's output and LSE in the backward (the ring's and the tiles' merged ones), and its arguments
changed every release (2.10 `is_causal` and no `scale`; 2.11 causal as `window_size=(-1, 0)`; 2.12 `enable_gqa`
required for GQA). One op pair keeps one LSE contract. Contract (aten/src/ATen/native/transformers/cuda/flash_attn/
flash_api.cpp, `mha_fwd` / `mha_bwd` / `mha_varlen_fwd` / `mha_varlen_bwd`):

- q, k, v fp16 or bf16 ("FlashAttention only support fp16 and bf16 data type"), on sm80 or newer, with the last
  dimension contiguous ("must have contiguous last dimension"; other strides are read as given); one head size for
  q, k and v, a multiple of 8, at most 256 (the raw ops do not pad it; SDPA does).
- dense `[B, S, H, D]`; varlen `[T, H, D]` with int32 contiguous `cu_seqlens` of length segments + 1.
- GQA native: `H % H_kv == 0`, dk/dv come back with H_kv heads (summed over the group inside).
- causal is aligned bottom-right when Sq != Sk; the plans only ask it of square blocks.
- LSE float32 `[B, H, Sq]` (dense) or `[H, T]` (varlen, unpadded). The backward checks nothing of it and indexes
  its data pointer as that contiguous layout (`row_offset_lse`), so a strided LSE is read silently wrong: it is
  always handed over as a contiguous float32 tensor.
- the backward reads its rng arguments only with dropout; torch passes zeros(2, uint64) and empty(0).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.attention.lse.varlen import VarlenKernel

MAX_HEAD_DIM = 256


def flash_supports(dtype: torch.dtype, head_dim: int, head_dim_v: int) -> bool:
    """Whether torch's FlashAttention-2 takes these inputs (device capability aside)."""
    return (
        dtype in (torch.float16, torch.bfloat16)
        and head_dim == head_dim_v
        and head_dim % 8 == 0
        and head_dim <= MAX_HEAD_DIM
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TorchFlashOps:
    """The adapter for `aten._flash_attention_forward` / `_flash_attention_backward` (see the module contract).

    Tensors are dense `[B, S, H, D]` or, with `cu_q`/`cu_k`, varlen `[T, H, D]`. `ops` is `torch.ops.aten`
    (a stand-in that enforces the same contract in the CPU tests)."""

    def __init__(self, ops: Any = None) -> None:
        self._ops = ops if ops is not None else torch.ops.aten

    @staticmethod
    def _check(q: torch.Tensor, v: torch.Tensor) -> None:
        if not flash_supports(q.dtype, q.shape[-1], v.shape[-1]):
            raise ValueError(
                f"torch's flash kernel takes fp16/bf16 with one head size, a multiple of 8 up to {MAX_HEAD_DIM}; got "
                f"{q.dtype}, head sizes {q.shape[-1]}/{v.shape[-1]}."
            )

    def forward(self, q, k, v, *, scale: float, causal: bool, cu_q=None, cu_k=None, max_q: int, max_k: int):
        """(out like q, LSE float32 `[B, H, Sq]` or `[H, T]`)."""
        self._check(q, v)
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        out, lse, *_ = self._ops._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, scale: float, causal: bool, cu_q=None, cu_k=None, max_q, max_k):
        """(dq, dk, dv) like q, k, v; `lse` as the forward returns it (made contiguous float32 here)."""
        self._check(q, v)
        q, k, v, out, dout = (_last_dim_contiguous(t) for t in (q, k, v, out, dout))
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # read only with dropout
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = self._ops._flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
            scale=scale,
        )  # fmt: skip
        return dq, dk, dv


class TorchFlashKernel:
    """Dense blocks (fully visible or square causal) on torch's FlashAttention-2; q/k/v read as strided views."""

    name = "torch_flash"

    def __init__(self, ops: Any = None) -> None:
        self.ops = TorchFlashOps(ops)

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        if allowed is not None or segments is not None:
            raise ValueError(f"{self.name} takes no mask; masked blocks go to a varlen or mask kernel.")
        out, lse = self.ops.forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal=causal,
            max_q=q.shape[2], max_k=k.shape[2],
        )  # fmt: skip
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        dq, dk, dv = self.ops.backward(
            *(t.transpose(1, 2) for t in (dout, q, k, v, out)), lse, scale=scale, causal=causal,
            max_q=q.shape[2], max_k=k.shape[2],
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def torch_flash_varlen(ops: Any = None) -> VarlenKernel:
    """Packed blocks on torch's varlen FlashAttention-2 (segments as `cu_seqlens`)."""
    adapter = TorchFlashOps(ops)

    def seg(s) -> dict[str, Any]:
        return {"causal": s.causal, "cu_q": s.cu_q, "cu_k": s.cu_k, "max_q": s.max_q, "max_k": s.max_k}

    def call_fwd(q, k, v, s, scale):
        return adapter.forward(q, k, v, scale=scale, **seg(s))

    def call_bwd(dout, q, k, v, out, lse, s, scale):
        return adapter.backward(dout, q, k, v, out, lse, scale=scale, **seg(s))

    return VarlenKernel("torch_flash_varlen", call_fwd, call_bwd)

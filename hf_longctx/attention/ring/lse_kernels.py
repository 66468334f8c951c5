"""Attention kernels that return the log-sum-exp (LSE), for ring attention's block-wise softmax.

Every adapter takes and returns one layout: q `[bs, hc, sq, hs]`, k/v `[bs, hc_kv, sk, hs]` (GQA:
`hc % hc_kv == 0`, query head h reads kv head `h // (hc / hc_kv)`), out `[bs, hc, sq, hs_v]` in q's
dtype and LSE `[bs, hc, sq]` contiguous, natural log, in `lse_dtype(q.dtype)` (float64 for float64
inputs, else float32). `allowed` is an optional boolean `[bs, 1, sq, sk]` mask; `causal` is only
ever asked for square blocks, so top-left vs bottom-right alignment never matters. A row without
any visible key may come back with any LSE: ring.py overwrites it with -inf. The backward takes the
*global* out and LSE (the merged ones), which makes the per-block gradients exact partial sums.

`select_kernel(q, masked)` is the main entry. CPU: torch's flash kernel
(`_scaled_dot_product_flash_attention_for_cpu` and its backward). CUDA: flash-attn 3 or 2 when
installed (dense blocks), torch's memory-efficient kernel (blocks with a mask), each probed from the
installed signature; the CUDA adapters are not exercised by the CPU test suite (`tests/gpu`).
`MathKernel` (explicit softmax, closed-form backward) runs anywhere and is the fallback.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from functools import cache
from typing import Any, Protocol

import torch

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulator / LSE dtype: float64 keeps float64 references meaningful, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BlockKernel(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        allowed: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        allowed: torch.Tensor | None,
        scale: float,
    ) -> Grads: ...


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if allowed is None:
        return None
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, float("-inf"))


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else torch.nn.functional.pad(x, (0, size - x.shape[-1]))


class CpuFlashKernel:
    """torch's CPU flash kernel. It needs one head size for q, k and v, so a value head size that
    differs (MLA) is zero-padded: padded value columns give zero outputs and are sliced off, and the
    scores (hence LSE) do not change. It rejects boolean masks, so `allowed` becomes 0 / -inf."""

    name = "cpu_flash"

    def forward(self, q, k, v, *, causal, allowed, scale):
        dv, d = v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v = (_pad_last(t.contiguous(), d) for t in (q, k, v))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale
        )
        return out[..., :dv], lse.to(lse_dtype(q.dtype)).contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale):
        dq_size, dv, d = q.shape[-1], v.shape[-1], max(q.shape[-1], v.shape[-1])
        q, k, v, out, dout = (_pad_last(t.contiguous(), d) for t in (q, k, v, out, dout))
        gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=_additive(allowed, q.dtype), scale=scale
        )
        return gq[..., :dq_size], gk[..., :dq_size], gv[..., :dv]


class MathKernel:
    """Explicit masked softmax in float32 (float64 for float64 inputs) with the closed-form flash
    backward; O(sq x sk) memory, so only a fallback and a reference. Empty rows get LSE = -inf."""

    name = "math"

    @staticmethod
    def _scores(q, k, causal, allowed, scale):
        acc = lse_dtype(q.dtype)
        group = q.shape[1] // k.shape[1]
        kx = k.to(acc).repeat_interleave(group, dim=1)
        s = torch.matmul(q.to(acc), kx.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        return s, group

    @staticmethod
    def _probs(s, lse):
        safe = lse.masked_fill(lse == float("-inf"), 0.0)
        return torch.exp(s - safe.unsqueeze(-1))

    def forward(self, q, k, v, *, causal, allowed, scale):
        s, group = self._scores(q, k, causal, allowed, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = self._probs(s, lse)
        out = torch.matmul(p, v.to(s.dtype).repeat_interleave(group, dim=1))
        return out.to(q.dtype), lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale):
        s, group = self._scores(q, k, causal, allowed, scale)
        p = self._probs(s, lse.to(s.dtype))
        acc = s.dtype
        vx = v.to(acc).repeat_interleave(group, dim=1)
        do = dout.to(acc)
        dp = torch.matmul(do, vx.transpose(-1, -2))
        delta = (do * out.to(acc)).sum(-1, keepdim=True)  # D from the global output
        ds = p * (dp - delta)
        gq = torch.matmul(ds, k.to(acc).repeat_interleave(group, dim=1)) * scale
        gk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
        gv = torch.matmul(p.transpose(-1, -2), do)
        bs, hc_kv = k.shape[:2]
        gk = gk.unflatten(1, (hc_kv, group)).sum(2)
        gv = gv.unflatten(1, (hc_kv, group)).sum(2)
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


# ---- CUDA adapters (probed from the installed signatures; exercised by tests/gpu only) -------------

# Values for every keyword the flash-attn 2.x / 3.x private forward/backward functions have taken;
# a required parameter outside this table means an unknown release, refused at probe time.
_FLASH_DEFAULTS: dict[str, Any] = {
    "dropout_p": 0.0,
    "window_size_left": -1,
    "window_size_right": -1,
    "softcap": 0.0,
    "alibi_slopes": None,
    "return_softmax": False,
    "deterministic": True,
    "rng_state": None,
    "k_new": None,
    "v_new": None,
    "qv": None,
    "out": None,
    "out_": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k": None,
    "cu_seqlens_k_new": None,
    "seqused_q": None,
    "seqused_k": None,
    "max_seqlen_q": None,
    "max_seqlen_k": None,
    "page_table": None,
    "kv_batch_idx": None,
    "leftpad_k": None,
    "rotary_cos": None,
    "rotary_sin": None,
    "seqlens_rotary": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "attention_chunk": 0,
    "rotary_interleaved": True,
    "scheduler_metadata": None,
    "num_splits": 1,
    "pack_gqa": None,
    "sm_margin": 0,
}


def flash_call_kwargs(fn: Callable[..., Any], given: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `fn` from `given` and `_FLASH_DEFAULTS`, by parameter name.

    Raises:
        ValueError: `fn` has a required parameter neither table knows (an unsupported release).
    """
    kwargs = {}
    for name, param in inspect.signature(fn).parameters.items():
        if name in given:
            kwargs[name] = given[name]
        elif name in _FLASH_DEFAULTS:
            kwargs[name] = _FLASH_DEFAULTS[name]
        elif param.default is inspect.Parameter.empty:
            raise ValueError(f"{fn.__module__}.{fn.__name__} has an unknown required parameter {name!r}.")
    return kwargs


class FlashAttnKernel:
    """flash-attn 2 (`flash_attn.flash_attn_interface`) or 3 (`flash_attn_interface`), dense blocks.

    Layout [bs, s, hc, hs]; LSE float32 [bs, hc, sq]; the backward writes into preallocated dq/dk/dv
    (GQA native: dk/dv come back with the kv heads). Releases before 2.7 returned 8 forward values
    with the LSE at index 5. Each block's output is rounded to q's dtype by the kernel (bf16 runs:
    see the README on ring precision).
    """

    def __init__(self, module: Any, name: str) -> None:
        self.name = name
        self._fwd, self._bwd = module._flash_attn_forward, module._flash_attn_backward
        # Probe once: an unknown required parameter refuses this module at selection time.
        names = ("q", "k", "v", "softmax_scale", "causal", "is_causal", "dout", "out", "softmax_lse", "dq", "dk", "dv")
        for fn in (self._fwd, self._bwd):
            flash_call_kwargs(fn, dict.fromkeys(names))

    def forward(self, q, k, v, *, causal, allowed, scale):
        if allowed is not None:
            raise ValueError(f"{self.name} takes no mask; ring.py routes masked blocks to another kernel.")
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        given = {"q": qt, "k": kt, "v": vt, "softmax_scale": scale, "causal": causal, "is_causal": causal}
        res = self._fwd(**flash_call_kwargs(self._fwd, given))
        out, lse = (res[0], res[5]) if len(res) >= 8 else (res[0], res[1])
        return out[..., : v.shape[-1]].transpose(1, 2), lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale):
        qt, kt, vt, ot, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        given = {
            "dout": dot,
            "q": qt,
            "k": kt,
            "v": vt,
            "out": ot,
            "softmax_lse": lse.float().contiguous(),
            "dq": dq,
            "dk": dk,
            "dv": dv,
            "softmax_scale": scale,
            "causal": causal,
            "is_causal": causal,
        }
        self._bwd(**flash_call_kwargs(self._bwd, given))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _sum_groups(g: torch.Tensor, hc_kv: int) -> torch.Tensor:
    return g.unflatten(1, (hc_kv, g.shape[1] // hc_kv)).sum(2)


class CudaEfficientKernel:
    """torch's memory-efficient CUDA kernel: takes an additive bias (masked blocks) and returns the
    LSE, padded along the query axis on some releases (sliced here, re-padded for the backward).
    No native GQA: kv heads are expanded and their gradients summed back."""

    name = "cuda_efficient"

    def forward(self, q, k, v, *, causal, allowed, scale):
        kx, vx = _expand_kv(q, k), _expand_kv(q, v)
        bias = _additive(allowed, q.dtype)
        bias = None if bias is None else bias.expand(q.shape[0], q.shape[1], -1, -1)
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q.contiguous(), kx.contiguous(), vx.contiguous(), bias, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale):
        kx, vx = _expand_kv(q, k).contiguous(), _expand_kv(q, v).contiguous()
        bias = _additive(allowed, q.dtype)
        bias = None if bias is None else bias.expand(q.shape[0], q.shape[1], -1, -1).contiguous()
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        gq, gk, gv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q.contiguous(), kx, vx, bias, out.contiguous(), lse.float().contiguous(),
            seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return gq, _sum_groups(gk, k.shape[1]), _sum_groups(gv, v.shape[1])


@cache
def _flash_attn_module() -> FlashAttnKernel | None:
    for module_name, name in (
        ("flash_attn_interface", "flash_attn_3"),
        ("flash_attn.flash_attn_interface", "flash_attn_2"),
    ):
        try:
            return FlashAttnKernel(importlib.import_module(module_name), name)
        except (ImportError, AttributeError, ValueError):
            continue
    return None


_CPU, _MATH, _EFFICIENT = CpuFlashKernel(), MathKernel(), CudaEfficientKernel()


def select_kernel(q: torch.Tensor, masked: bool, same_head_size: bool = True) -> BlockKernel:
    """The kernel for one block of `q`'s device and dtype; `masked` blocks need an `allowed` mask.

    CPU: the flash kernel (any float dtype). CUDA: flash-attn for unmasked fp16/bf16 blocks with equal
    head sizes, torch's efficient kernel otherwise (float64: the math kernel).
    """
    if q.device.type == "cpu":
        return _CPU
    if q.device.type == "cuda" and q.dtype != torch.float64:
        flash = _flash_attn_module()
        if flash is not None and not masked and same_head_size and q.dtype in (torch.float16, torch.bfloat16):
            return flash
        return _EFFICIENT
    return _MATH

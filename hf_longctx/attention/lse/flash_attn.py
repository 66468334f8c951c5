"""flash-attn 2 (`flash_attn.flash_attn_interface`) and 3 (`flash_attn_interface`) as block kernels, used when
installed (never required): dense blocks read q/k/v as strided views, packed blocks run its varlen kernel.

flash-attn's private functions are found by API, not by signature guessing alone: flash-attn >= 2.7
(`_compat.MIN_FLASH_ATTN`) and FA3 expose them as torch custom ops, whose parameters are read from the op schema
(`_compat.op_parameters`); an unknown required parameter refuses the module with a reason that `detect_flash_attn`
returns for the log. Its LSE contract is torch's flash one (`torch_flash.py`): float32, read by data pointer as
contiguous `[B, H, Sq]` / `[H, T]`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from hf_longctx._compat import MIN_FLASH_ATTN, flash_attn_version, op_parameters
from hf_longctx.attention.lse.varlen import VarlenKernel, segment_arguments

# Values for every keyword the flash-attn 2.7+ / 3.x private forward/backward functions have taken;
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
    "zero_tensors": False,
    "block_table": None,
    "k_new": None,
    "v_new": None,
    "qv": None,
    "out_": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k": None,
    "cu_seqlens_k_new": None,
    "seqused_q": None,
    "seqused_k": None,
    "sequed_q": None,
    "sequed_k": None,
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


def _label(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "_qualname", None) or getattr(fn, "__qualname__", None) or fn)


def flash_call_kwargs(fn: Callable[..., Any], given: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for `fn` (a function or torch custom op) from `given` and `_FLASH_DEFAULTS`.

    Raises:
        ValueError: `fn` has a required parameter neither table knows (an unsupported release).
    """
    kwargs = {}
    for name, required in op_parameters(fn).items():
        if name in given:
            kwargs[name] = given[name]
        elif name in _FLASH_DEFAULTS:
            kwargs[name] = _FLASH_DEFAULTS[name]
        elif required:
            raise ValueError(f"{_label(fn)} has an unknown required parameter {name!r}.")
    return kwargs


def _probe(*fns: Callable[..., Any]) -> None:
    names = ("q", "k", "v", "dout", "out", "softmax_lse", "dq", "dk", "dv", "softmax_scale", "causal", "is_causal")
    names += ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    for fn in fns:
        flash_call_kwargs(fn, dict.fromkeys(names))


def _flash_given(scale: float, causal: bool, **tensors: Any) -> dict[str, Any]:
    return {**tensors, "softmax_scale": scale, "causal": causal, "is_causal": causal}


def _flash_layout(t: torch.Tensor) -> torch.Tensor:
    """`[bs, h, s, d]` -> flash-attn's `[bs, s, h, d]` as a view: its kernels read any batch, row and head strides
    and only need a contiguous last dimension (flash-attn's own wrappers copy only then), so K/V slices of a
    longer sequence are read in place."""
    t = t.transpose(1, 2)
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashAttnKernel:
    """flash-attn 2 (`flash_attn.flash_attn_interface`) or 3 (`flash_attn_interface`), dense blocks.

    Layout [bs, s, hc, hs], read as strided views (`_flash_layout`); LSE float32 [bs, hc, sq]; the backward
    writes into preallocated dq/dk/dv (GQA native: dk/dv come back with the kv heads). Each block's output is
    rounded to q's dtype by the kernel (bf16 runs: see the README on ring precision).
    """

    def __init__(self, fwd: Callable[..., Any], bwd: Callable[..., Any], name: str) -> None:
        self.name, self._fwd, self._bwd = name, fwd, bwd
        _probe(fwd, bwd)

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        if allowed is not None or segments is not None:
            raise ValueError(f"{self.name} takes no mask; masked blocks go to a varlen or mask kernel.")
        qt, kt, vt = (_flash_layout(t) for t in (q, k, v))
        res = self._fwd(**flash_call_kwargs(self._fwd, _flash_given(scale, causal, q=qt, k=kt, v=vt)))
        return res[0][..., : v.shape[-1]].transpose(1, 2), res[1].float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        qt, kt, vt, ot, dot = (_flash_layout(t) for t in (q, k, v, out, dout))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (qt, kt, vt))  # contiguous
        given = _flash_given(
            scale, causal, dout=dot, q=qt, k=kt, v=vt, out=ot, softmax_lse=lse.float().contiguous(), dq=dq, dk=dk, dv=dv
        )
        self._bwd(**flash_call_kwargs(self._bwd, given))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def flash_varlen_kernel(fwd: Callable[..., Any], bwd: Callable[..., Any], name: str) -> VarlenKernel:
    """A `VarlenKernel` on flash-attn's private varlen forward/backward (2.7+ or FA3), probed now."""
    _probe(fwd, bwd)

    def call_fwd(q, k, v, seg, scale):
        res = fwd(**flash_call_kwargs(fwd, _flash_given(scale, seg.causal, q=q, k=k, v=v, **segment_arguments(seg))))
        return res[0], res[1]

    def call_bwd(dout, q, k, v, out, lse, seg, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        given = _flash_given(
            scale,
            seg.causal,
            dout=dout,
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse.float().contiguous(),  # read by data pointer as contiguous float32 [H, T]
            dq=dq,
            dk=dk,
            dv=dv,
            **segment_arguments(seg),
        )
        bwd(**flash_call_kwargs(bwd, given))
        return dq, dk, dv

    return VarlenKernel(f"{name}_varlen", call_fwd, call_bwd)


def detect_flash_attn() -> tuple[FlashAttnKernel | None, VarlenKernel | None, str]:
    """flash-attn's dense and varlen kernels (FA3 first, then FA2), and a line saying what was found."""
    reasons = []
    for module_name, name in (
        ("flash_attn_interface", "flash_attn_3"),
        ("flash_attn.flash_attn_interface", "flash_attn_2"),
    ):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        found = flash_attn_version(module)
        if name == "flash_attn_2" and (found is None or found < MIN_FLASH_ATTN):
            reasons.append(f"flash-attn {found} is older than {MIN_FLASH_ATTN} (upgrade it to use it)")
            continue
        try:
            fwd, bwd = module._flash_attn_forward, module._flash_attn_backward
            dense = FlashAttnKernel(fwd, bwd, name)
            if name == "flash_attn_2":
                fwd, bwd = module._flash_attn_varlen_forward, module._flash_attn_varlen_backward
            return dense, flash_varlen_kernel(fwd, bwd, name), f"{name} ({module_name}, version {found})"
        except (AttributeError, ValueError) as err:
            reasons.append(f"{module_name} refused: {err}")
    return None, None, "; ".join(reasons) or "flash-attn is not installed"

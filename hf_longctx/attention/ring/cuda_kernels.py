"""The ring's CUDA block kernels: flash-attn 2/3 (dense and varlen), torch's varlen flash, torch's
memory-efficient kernel. Same layout contract as `lse_kernels.py`; exercised on GPU by `tests/gpu`
and on CPU through stand-ins (`tests/_flash_standin.py`: real `torch.library.custom_op`s).

flash-attn's private functions are found by API, not by signature guessing alone: flash-attn >= 2.7
(`_compat.MIN_FLASH_ATTN`) and FA3 expose them as torch custom ops, whose parameters are read from
the op schema (`_compat.op_parameters`); an unknown required parameter refuses the module with a
reason that `detect_flash_attn` returns for the log.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from hf_longctx._compat import MIN_FLASH_ATTN, flash_attn_version, op_parameters
from hf_longctx.attention.ring.plan import Segments

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


def _tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[bs, h, n, d] -> the listed tokens of the row-major (b, n) numbering, [T, h, d]."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]).index_select(0, index)


def _untokens(t: torch.Tensor, index: torch.Tensor, bs: int, n: int) -> torch.Tensor:
    """Inverse of `_tokens`: [T, h, d] -> [bs, h, n, d], zero where no token was listed."""
    full = torch.zeros((bs * n, *t.shape[1:]), dtype=t.dtype, device=t.device).index_copy_(0, index, t)
    return full.view(bs, n, *t.shape[1:]).transpose(1, 2)


class VarlenKernel:
    """A varlen flash kernel on a block's `Segments`: only the rows of some segment are gathered and
    computed (O(block) memory, no mask), so a row that sees no key is out 0 / LSE -inf by
    construction; the backward scatters dq/dk/dv back. `call_fwd` / `call_bwd` adapt one API:
    flash-attn 2's `_flash_attn_varlen_*`, FA3's `_flash_attn_*` with cu_seqlens, or torch's."""

    def __init__(self, name: str, call_fwd: Callable[..., Any], call_bwd: Callable[..., Any]) -> None:
        self.name, self._call_fwd, self._call_bwd = name, call_fwd, call_bwd

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        if segments is None:
            raise ValueError(f"{self.name} runs packed blocks only (a plan with segments).")
        bs, hc, nr = q.shape[:3]
        qt, kt, vt = _tokens(q, segments.q_tokens), _tokens(k, segments.k_tokens), _tokens(v, segments.k_tokens)
        out_t, lse_t = self._call_fwd(qt, kt, vt, segments, scale)  # [Tq, hc, dv], [hc, Tq]
        out = _untokens(out_t[..., : v.shape[-1]], segments.q_tokens, bs, nr)
        lse = torch.full((hc, bs * nr), float("-inf"), dtype=torch.float32, device=q.device)
        lse.index_copy_(1, segments.q_tokens, lse_t.float())
        return out, lse.view(hc, bs, nr).transpose(0, 1).contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        bs, hc, nr = q.shape[:3]
        qi, ki = segments.q_tokens, segments.k_tokens
        lse_t = lse.float().transpose(0, 1).reshape(hc, -1).index_select(1, qi).contiguous()
        grads = self._call_bwd(
            _tokens(dout, qi), _tokens(q, qi), _tokens(k, ki), _tokens(v, ki), _tokens(out, qi), lse_t, segments, scale
        )
        nc = k.shape[2]
        return _untokens(grads[0], qi, bs, nr), _untokens(grads[1], ki, bs, nc), _untokens(grads[2], ki, bs, nc)


def _seg_given(seg: Segments) -> dict[str, Any]:
    return {
        "cu_seqlens_q": seg.cu_q,
        "cu_seqlens_k": seg.cu_k,
        "max_seqlen_q": seg.max_q,
        "max_seqlen_k": seg.max_k,
    }


def flash_varlen_kernel(fwd: Callable[..., Any], bwd: Callable[..., Any], name: str) -> VarlenKernel:
    """A `VarlenKernel` on flash-attn's private varlen forward/backward (2.7+ or FA3), probed now."""
    _probe(fwd, bwd)

    def call_fwd(q, k, v, seg, scale):
        res = fwd(**flash_call_kwargs(fwd, _flash_given(scale, seg.causal, q=q, k=k, v=v, **_seg_given(seg))))
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
            softmax_lse=lse,
            dq=dq,
            dk=dk,
            dv=dv,
            **_seg_given(seg),
        )
        bwd(**flash_call_kwargs(bwd, given))
        return dq, dk, dv

    return VarlenKernel(f"{name}_varlen", call_fwd, call_bwd)


def _torch_varlen_fwd(q, k, v, seg, scale):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal, False, scale=scale
    )
    return out, lse


def _torch_varlen_bwd(dout, q, k, v, out, lse, seg, scale):
    placeholder = torch.zeros(2, dtype=torch.int64, device=q.device)  # rng state: unused without dropout
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    kx = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) if k.shape[1] != q.shape[1] else k
    vx = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1) if v.shape[1] != q.shape[1] else v
    gq, gk, gv = torch.ops.aten._flash_attention_backward(
        dout, q, kx, vx, out, lse, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, seg.causal, placeholder, unused,
        scale=scale,
    )  # fmt: skip
    hkv = k.shape[1]
    return gq, gk.unflatten(1, (hkv, -1)).sum(2), gv.unflatten(1, (hkv, -1)).sum(2)


TORCH_VARLEN = VarlenKernel("torch_flash_varlen", _torch_varlen_fwd, _torch_varlen_bwd)

# The memory-efficient kernel reads the bias with a row stride that is a multiple of 16 elements;
# SDPA pads the last dimension to that and slices it back (a view) before calling it.
MEM_EFF_ALIGNMENT = 16


def aligned_bias(allowed: torch.Tensor, dtype: torch.dtype, heads: int) -> torch.Tensor:
    """Additive 0 / -inf bias `[bs, heads, nr, nc]` from a boolean `[bs, 1, nr, nc]` mask: padded to an
    aligned row stride and sliced back, heads broadcast with stride 0 (never copied per head)."""
    nc = allowed.shape[-1]
    padded = -(-nc // MEM_EFF_ALIGNMENT) * MEM_EFF_ALIGNMENT
    bias = torch.full((*allowed.shape[:-1], padded), float("-inf"), dtype=dtype, device=allowed.device)
    bias[..., :nc].masked_fill_(allowed, 0.0)
    return bias[..., :nc].expand(allowed.shape[0], heads, -1, -1)


def _expand_kv(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _sum_groups(g: torch.Tensor, hc_kv: int) -> torch.Tensor:
    return g.unflatten(1, (hc_kv, g.shape[1] // hc_kv)).sum(2)


class CudaEfficientKernel:
    """torch's memory-efficient CUDA kernel: masked blocks that no flash kernel takes (fp32, head sizes
    that differ). It takes an aligned additive bias (`aligned_bias`) and returns the LSE, padded along
    the query axis on some releases (sliced here). No native GQA: kv heads are expanded and their
    gradients summed back. `ops` is `torch.ops.aten` (a recorder in the CPU tests)."""

    name = "cuda_efficient"

    def __init__(self, ops: Any = None) -> None:
        self._ops = ops if ops is not None else torch.ops.aten

    def _bias(self, q, k, allowed, segments):
        if allowed is None and segments is not None:
            allowed = segments.mask(q.shape[0], q.shape[2], k.shape[2])
        return None if allowed is None else aligned_bias(allowed, q.dtype, q.shape[1])

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        kx, vx = _expand_kv(q, k), _expand_kv(q, v)
        out, lse, _, _ = self._ops._scaled_dot_product_efficient_attention(
            q.contiguous(), kx.contiguous(), vx.contiguous(), self._bias(q, k, allowed, segments), True, 0.0, causal,
            scale=scale,
        )  # fmt: skip
        return out, lse[..., : q.shape[2]].float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        kx, vx = _expand_kv(q, k).contiguous(), _expand_kv(q, v).contiguous()
        seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)
        gq, gk, gv, _ = self._ops._scaled_dot_product_efficient_attention_backward(
            dout.contiguous(), q.contiguous(), kx, vx, self._bias(q, k, allowed, segments), out.contiguous(),
            lse.float().contiguous(), seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return gq, _sum_groups(gk, k.shape[1]), _sum_groups(gv, v.shape[1])


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

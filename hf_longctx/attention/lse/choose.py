"""Which block kernel runs a block: `choose_kernel` (device, dtype, block kind) and `select_kernel` (a ring plan).

CPU: torch's CPU flash kernel, any float dtype; packed blocks segment by segment (`loop.segment_loop`). CUDA,
fp16/bf16 with a head size flash takes (equal for q, k and v, a multiple of 8, at most 256) on sm80+: flash-attn's
kernels when installed, else torch's own FlashAttention-2, for dense blocks and packed (varlen) ones; torch's
memory-efficient kernel for blocks with any other mask (window tiles: small masks), for fp32 and for head sizes
over 256, packed blocks then segment by segment; float64, head sizes the efficient kernel's alignment refuses (not
a multiple of 8 in fp16/bf16, of 4 in fp32) and other devices: the math kernel. Each (device, dtype, block kind)
choice is logged once per process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from hf_longctx.attention.lse.contract import BlockKernel
from hf_longctx.attention.lse.cpu import CpuFlashKernel, MathKernel
from hf_longctx.attention.lse.efficient import EfficientKernel, efficient_supports
from hf_longctx.attention.lse.flash_attn import detect_flash_attn
from hf_longctx.attention.lse.loop import segment_loop
from hf_longctx.attention.lse.torch_flash import TorchFlashKernel, flash_supports, torch_flash_varlen

logger = logging.getLogger(__name__)
_CPU, _MATH = CpuFlashKernel(), MathKernel()
_CPU_PACKED = segment_loop(_CPU)
_LOGGED: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class CudaKernels:
    """The CUDA kernel of each block kind: dense, packed (varlen) and masked (any other mask, fp32); `packed`: the
    masked kernel segment by segment, for packed blocks flash does not take."""

    dense: BlockKernel
    varlen: BlockKernel
    masked: BlockKernel
    packed: BlockKernel


def cuda_kernels(ops: Any = None, flash_attn: bool = True) -> CudaKernels:
    """flash-attn's dense / varlen kernels when installed (and `flash_attn`), else torch's; torch's efficient kernel
    for masks. `ops`: the aten namespace (a stand-in in the CPU tests)."""
    dense, varlen = detect_flash_attn()[:2] if flash_attn else (None, None)
    efficient = EfficientKernel(ops)
    return CudaKernels(
        dense or TorchFlashKernel(ops), varlen or torch_flash_varlen(ops), efficient, segment_loop(efficient)
    )


@cache
def _cuda() -> CudaKernels:
    found = detect_flash_attn()[2]
    logger.info("block attention: flash-attn probe: %s", found)
    return cuda_kernels()


@cache
def _flash_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)  # FlashAttention-2 needs sm80+


def choose_kernel(
    device_type: str,
    dtype: torch.dtype,
    *,
    masked: bool,
    varlen: bool = False,
    head_dims: tuple[int, int] = (64, 64),
    kernels: CudaKernels | None = None,
) -> BlockKernel:
    """The kernel for one block of `device_type` tensors in `dtype` (see the module docstring).

    Args:
        masked: the block needs more than the causal flag (a mask or varlen segments).
        varlen: the block is planned as `Segments` (packed documents).
        head_dims: (q/k head size, v head size).
        kernels: the CUDA kernels (default: this process's, probed once); tests pass stand-in ones.
    """
    if device_type == "cpu":
        kernel: BlockKernel = _CPU_PACKED if varlen else _CPU
    elif device_type == "cuda" and dtype != torch.float64 and efficient_supports(dtype, *head_dims):
        cuda = kernels or _cuda()
        kernel = cuda.packed if varlen else cuda.masked
        # Stand-in kernels (tests on CPU tensors) skip the device's capability.
        capable = kernels is not None or _flash_capable(torch.cuda.current_device())
        flash = capable and flash_supports(dtype, *head_dims)
        if flash and (varlen or not masked):
            kernel = cuda.varlen if varlen else cuda.dense
    else:
        kernel = _MATH
    kind = ("packed" if varlen else "masked" if masked else "dense") + f" (head sizes {head_dims[0]}/{head_dims[1]})"
    key = (device_type, str(dtype), kind)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("block attention: %s %s %s blocks use the %s kernel", device_type, dtype, kind, kernel.name)
    return kernel


def select_kernel(q: torch.Tensor, plan: Any, head_dim_v: int | None = None) -> BlockKernel:
    """The kernel for a ring `plan`'s block of `q` (its device and dtype decide, see `choose_kernel`)."""
    return choose_kernel(
        q.device.type,
        q.dtype,
        masked=plan.masked,
        varlen=plan.segments is not None,
        head_dims=(q.shape[-1], head_dim_v or q.shape[-1]),
    )

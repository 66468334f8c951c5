"""The block kernels on one GPU (`attention/lse/`): what `select_kernel` picks for every block of a ring.

No second GPU is needed: a virtual ring (`attention/ring/virtual.py`) loops over P ranks in one process with the same
planner, kernels and merge the ring runs per step (the backward with the merged output and LSE), and compares every
rank's output and dq/dk/dv with float64 autograd of an explicit masked softmax. fp16/bf16 are held to the error of
the same kernels on the whole row (world 1: one block), x2, plus what the ring adds by design: each block's output
and gradients come back rounded to the input dtype, and a key's gradient sums up to P such pieces (slack P * eps).
Run each test in its own process (scripts/gpu_check.sh does): a CUDA fault poisons the process it happens in.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_longctx.attention.lse.choose import choose_kernel, select_kernel
from hf_longctx.attention.ring.plan import VisibilityRule, plan_ring
from hf_longctx.attention.ring.virtual import reference, virtual_ring
from hf_longctx.data.layout import layout_indices

pytestmark = pytest.mark.gpu
EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-10}  # fp32: 1e-3, as this test always had
DOCS = [(101, 1, 211, 199), (51, 299, 162)]  # odd lengths; rows of blocks that see no key of the block


def _rule(kind: str, seq: int) -> VisibilityRule:
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in DOCS]).cuda()
    assert doc.shape[1] == seq
    packed = kind.startswith("packed")
    return VisibilityRule(doc if packed else None, window=37 if kind.endswith("window") else None)


def _inputs(seed: int, dtype: torch.dtype, seq: int = 512, d: int = 64, heads: tuple[int, int] = (8, 2)):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, heads[0], seq, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, heads[1], seq, d, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    return q, k, v, torch.randn(2, heads[0], seq, d, device="cuda", dtype=dtype, generator=g)


def _kernel_for(used: set[str]):
    def kernel_for(q, plan):
        kernel = select_kernel(q, plan)
        used.add(kernel.name)
        return kernel

    return kernel_for


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("kind", ["causal", "packed", "packed_window", "window"])
def test_virtual_ring_on_gpu_matches_float64(dtype, world, kind):
    q, k, v, dout = _inputs(world, dtype)
    seq, scale = q.shape[2], q.shape[-1] ** -0.5
    rule = _rule(kind, seq)
    pos = torch.arange(seq, device="cuda")
    ref = reference(q, k, v, dout, rule.allowed(pos, pos)[:, None], scale)
    used: set[str] = set()
    got = virtual_ring(q, k, v, dout, world, "zigzag", rule, scale, _kernel_for(used))
    single = virtual_ring(q, k, v, dout, 1, "contiguous", rule, scale, _kernel_for(set()))
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, single, ref, strict=True):
        assert not bool(a.isnan().any()), (name, used)
        err, base = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
        bound = 2 * base + world * EPS[dtype] * c.abs().max().item()
        assert err <= bound, (name, err, base, bound, used)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_each_kernel_gives_rows_without_keys_out_zero_and_lse_minus_inf(dtype):
    """Packed blocks (varlen: such rows are never computed) and masked blocks (the kernel's LSE 0 is cleared)."""
    q, k, v, _ = _inputs(0, dtype, seq=64, heads=(4, 2))
    seen = 0
    for kind in ("packed", "packed_window"):
        doc = torch.tensor([[0] * 20 + [1] * 30 + [2] * 14, [0] * 40 + [1] * 24], device="cuda")
        rule = VisibilityRule(doc, window=9 if kind == "packed_window" else None)
        idx = [layout_indices("zigzag", r, 4, 64).cuda() for r in range(4)]
        for rank in range(4):
            for src, plan in ((s, p) for s, parts in enumerate(plan_ring(idx, rank, rule)) for p in parts):
                if not plan.masked:
                    continue
                b = plan.batch_rows
                mask = plan.mask(2)[:, 0].expand(q[b].shape[0], -1, -1)  # [bs, rows, cols]
                empty = ~mask.any(-1)
                if not bool(empty.any()):
                    continue
                out, lse = select_kernel(q, plan).forward(
                    q[b][:, :, idx[rank]][:, :, plan.rows], k[b][:, :, idx[src]][:, :, plan.cols],
                    v[b][:, :, idx[src]][:, :, plan.cols], causal=plan.causal, allowed=plan.allowed,
                    scale=0.125, segments=plan.segments,
                )  # fmt: skip
                assert bool((lse.transpose(0, 1)[:, empty] == -math.inf).all())
                assert bool((out.transpose(0, 1)[:, empty] == 0).all())
                assert bool(torch.isfinite(lse.transpose(0, 1)[:, ~empty]).all())
                seen += 1
    assert seen >= 2


def test_blocks_take_torchs_flash_kernels_without_flash_attn():
    """Dense and packed fp16/bf16 blocks never go to the memory-efficient kernel (flash-attn when installed)."""
    dense = choose_kernel("cuda", torch.bfloat16, masked=False, head_dims=(128, 128)).name
    packed = choose_kernel("cuda", torch.bfloat16, masked=True, varlen=True, head_dims=(128, 128)).name
    assert dense in ("torch_flash", "flash_attn_2", "flash_attn_3"), dense
    assert packed.endswith("varlen"), packed
    assert choose_kernel("cuda", torch.float32, masked=False).name == "cuda_efficient"

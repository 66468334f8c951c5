"""GPU-only kernel paths through hf_longctx at SP=2 (skipped without CUDA; `scripts/gpu_check.sh` runs them).

NCCL refuses two ranks on one device, so SP=2 runs as two processes on the one GPU over gloo: hf_longctx
moves each collective's tensors to the host for gloo (`comm.group_device`), the kernels run on CUDA. Each
case is one training step on a packed row of three documents, compared with the fp32 plain model run
document by document (`benchmarks/gpu_check.py`); a leak control shows the comparison sees documents that
attend to each other.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from benchmarks import gpu_check

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def reference():
    return gpu_check.plain_step("eager", torch.float32, "cuda", per_document=True)


def test_leak_control_sees_cross_document_attention(reference):
    _, leak_grad = gpu_check._errors(
        *gpu_check.plain_step("eager", torch.float32, "cuda", per_document=False), reference
    )
    assert leak_grad > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention", "flash_attention_2"])
def test_sp2_packed_documents_exact_on_gpu_kernels(attn, dtype, reference):
    if attn == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            pytest.skip("flash-attn not installed (pip install -e '.[gpu]')")
        if dtype == torch.float32:
            pytest.skip("flash-attn has no fp32 kernel")
    torch.backends.cuda.matmul.allow_tf32 = False
    row = gpu_check.run_cell(attn, dtype, 2, "cuda", reference)
    assert row["status"] == "PASS", row

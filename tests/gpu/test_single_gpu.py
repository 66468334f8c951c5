"""`sp_size=1` on one GPU: hf_longctx's attention (per document of `position_ids`, the model's own sdpa kernel)
holds nothing of O(S^2) in forward and backward, in bf16 (torch's flash kernel) and in fp32 with grouped K/V, which
SDPA's memory-efficient kernel takes only expanded (its flash and math kernels alone take `enable_gqa`; math
holds [S, S] scores per head)."""

from __future__ import annotations

import pytest
import torch

from hf_longctx import SequenceParallelGroups, enable_sequence_parallel
from tests._models import tiny_model

pytestmark = pytest.mark.gpu
SEQ = 16384


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_row_on_one_gpu_holds_no_square(dtype):
    model = tiny_model("llama", num_heads=8, num_kv_heads=2, hidden=256, layers=1).to("cuda", dtype)
    model.config.max_position_embeddings = SEQ
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 128, (1, SEQ), device="cuda", generator=g)
    pos = torch.cat([torch.arange(6000), torch.arange(SEQ - 6000)]).unsqueeze(0).cuda()
    with enable_sequence_parallel(model, SequenceParallelGroups.single()):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=ids, position_ids=pos, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(loss)
    # SDPA's math kernel: fp32 scores of every head for the longer document (3.5 GB); the layer's activations
    # are about 0.25 GB.
    math_scores = 8 * (SEQ - 6000) ** 2 * 4
    assert peak < math_scores / 4, (peak, math_scores)

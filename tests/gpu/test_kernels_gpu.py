"""GPU-only kernel paths of the Ulysses wrapper (skipped without CUDA; run through the device tool).

At SP=1 on one GPU the wrapper still routes every layer through `kernels.attend`, so the flash varlen
`cu_seq_lens` and the flex `BlockMask` built from global positions are checked against a per-document
reference: each document run alone through the plain model.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu

DOCS = (37, 50, 41)


def _model(attn: str, dtype: torch.dtype):
    from tests._models import tiny_model

    return tiny_model("llama", num_heads=4, num_kv_heads=2, hidden=128, attn=attn).to("cuda", dtype)


def _per_document_logits(model, ids: torch.Tensor) -> torch.Tensor:
    parts, start = [], 0
    for n in DOCS:
        parts.append(model(input_ids=ids[:, start : start + n]).logits)
        start += n
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("attn", ["flash_attention_2", "flex_attention", "sdpa"])
def test_packed_documents_exact_on_gpu_kernels(attn):
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn not installed (pip install -e '.[gpu]')")
    import hf_longctx

    dtype = torch.bfloat16
    model = _model(attn, dtype)
    ids = torch.randint(0, 128, (1, sum(DOCS)), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        reference = _per_document_logits(_model("sdpa", dtype), ids).float()
        positions = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0).cuda()
        with hf_longctx.enable_sequence_parallel(model, hf_longctx.SequenceParallelGroups.single()):
            logits = model(input_ids=ids, position_ids=positions).logits.float()
    # bf16: compare against the bf16 per-document run with a bf16-sized tolerance.
    assert (logits - reference).abs().max().item() <= 5e-2 * reference.abs().max().item()


def test_bf16_loss_close_to_fp32():
    import hf_longctx

    groups = hf_longctx.SequenceParallelGroups.single()
    ids = torch.randint(0, 128, (2, 257), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    batch = hf_longctx.shard_batch({"input_ids": ids, "labels": ids}, groups)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _model("sdpa", dtype)
        with hf_longctx.enable_sequence_parallel(model, groups):
            shard = dict(batch)
            shift_labels = shard.pop("shift_labels")
            losses[dtype] = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups).item()
    assert abs(losses[torch.bfloat16] - losses[torch.float32]) <= 2e-2 * losses[torch.float32]

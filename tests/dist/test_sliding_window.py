"""Sliding-window attention under SP: the window must be applied on the global sequence.

Reference: the plain Mistral model (transformers builds its own sliding-window mask), full batch, one process.
"""

from __future__ import annotations

import torch

from tests import _flash_standin as flash_standin
from tests._dist import run_distributed

WINDOW, SEQ = 6, 29


def _model(attn: str):
    """The windowed Mistral; "flash_attention_2" is the CPU stand-in, installed by the caller."""
    from transformers import MistralConfig, MistralForCausalLM

    if attn == flash_standin.IMPLEMENTATION:
        return flash_standin.use_flash(_model("eager"))

    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=WINDOW,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return MistralForCausalLM(config).float()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss_and_grads(model, batch, groups):
    import hf_longctx

    shard = hf_longctx.shard_batch(batch, groups) if groups.sp_enabled else dict(batch)
    if groups.sp_enabled:
        shift_labels = shard.pop("shift_labels")
    else:
        from hf_longctx.data.sharding import make_shift_labels

        shift_labels = make_shift_labels(shard.pop("labels"), torch.arange(SEQ).expand(2, SEQ))
    loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _sp_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import hf_longctx

    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    flash_standin.install()
    out = {}
    for attn in ("sdpa", "eager", flash_standin.IMPLEMENTATION):
        model = _model(attn)
        with hf_longctx.enable_sequence_parallel(model, groups):
            loss, grads = _loss_and_grads(model, _batch(), groups)
        for g in grads.values():
            dist.all_reduce(g)
            g /= world_size
        out[attn] = (loss, grads)
    return out


def test_sliding_window_sp2_matches_plain_model():
    import hf_longctx

    results = run_distributed(_sp_worker, 2, timeout=180)[0]
    assert set(results) == {"sdpa", "eager", flash_standin.IMPLEMENTATION}
    for attn, (loss, grads) in results.items():
        # The plain model builds its own window mask; flash's reference is the plain eager model.
        ref_attn = "eager" if attn == flash_standin.IMPLEMENTATION else attn
        ref_loss, ref_grads = _loss_and_grads(_model(ref_attn), _batch(), hf_longctx.SequenceParallelGroups.single())
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), attn
        for name, ref in ref_grads.items():
            err = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
            assert err <= 1e-5, f"{attn} {name}: {err:.2e}"


def test_reference_window_is_active(monkeypatch):
    import hf_longctx

    groups = hf_longctx.SequenceParallelGroups.single()
    windowed = _loss_and_grads(_model("sdpa"), _batch(), groups)[0]
    monkeypatch.setattr(__import__(__name__, fromlist=["WINDOW"]), "WINDOW", 10**6)
    unwindowed = _loss_and_grads(_model("sdpa"), _batch(), groups)[0]
    assert abs(windowed - unwindowed) > 1e-4  # otherwise the SP test above would prove nothing

"""The memory flags under Ulysses SP=2 and SP=4 (and ring at 2, hybrid at 4): each flag on vs off, and all
flags vs a single-device run without SP, give the same loss and every parameter's gradient;
TRL's fused-head outputs too.

Each rank calls the model with its shard the way the Trainer does (labels = shift_labels and the global
token count as `num_items_in_batch`): the group's summed per-rank losses are the global token mean and
the summed per-rank gradients are the full gradients.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_distributed

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
FLAGS = {
    "off": {},
    "tiled_loss": {"tiled_loss": True},
    "tiled_mlp": {"tiled_mlp": 2},
    "offload_activations": {"offload_activations": True},
    "all": {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True},
}
# (arch, attn, kv heads): GQA on sdpa (also through TRL's fused head); at SP=2 also soft-capped logits +
# sliding windows on eager and MLA + MoE with a shared expert on sdpa (4 ranks on 2 cores are slow).
MODELS = {
    2: (("llama", "sdpa", 2), ("gemma2", "eager", 2), ("deepseek_v3", "sdpa", 4)),
    4: (("llama", "sdpa", 2),),
}
# The other SP backends (zigzag layout; hybrid = Ulysses 2 x ring 2): all flags vs none vs a single device.
OTHER_BACKENDS = {2: ("ring",), 4: ("hybrid",)}


def _batch() -> dict[str, torch.Tensor]:
    """One packed row (documents of 13, 11 and 16 tokens; completion-only labels on the second) and
    a right-padded row: 40 tokens, shards of 20 (SP=2) and 10 (SP=4)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 128, (2, 40), generator=g)
    positions = torch.stack([torch.cat([torch.arange(13), torch.arange(11), torch.arange(16)]), torch.arange(40)])
    labels = ids.clone()
    labels[0, 13:20] = -100
    labels[1, 33:] = -100
    mask = torch.ones_like(ids)
    mask[1, 33:] = 0
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask}


def _run(model, batch, groups, fused: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    import hf_longctx

    shard = hf_longctx.shard_batch(batch, groups)
    shift = shard.pop("shift_labels")
    count = shift.ne(-100).sum()
    dist.all_reduce(count, group=groups.sp_group)
    if fused:
        out = model(**shard, shift_labels=shift, fused_lm_head=True, num_items_in_batch=count)
        per_token = out.log_probs.detach().clone()
    else:
        out = model(**shard, labels=shift, shift_labels=shift, num_items_in_batch=count)
        per_token = None
    out.loss.backward()
    names = [n for n, _ in model.named_parameters()]
    flat = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()])
    model.zero_grad(set_to_none=True)
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=groups.sp_group)
    dist.all_reduce(flat, group=groups.sp_group)
    grads, offset = {}, 0
    for name, p in zip(names, model.parameters(), strict=True):
        grads[name] = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return loss, grads, per_token


def _reference(arch, attn, kv, batch):
    """Single device, no SP, no flags: the model's own loss over the full batch (document mask explicit)."""
    from tests._models import tiny_model
    from tests.dist._parity import Case, document_causal_mask, hand_shift_labels

    model = tiny_model(arch, attn=attn, num_kv_heads=kv)
    doc = torch.cat([torch.zeros(13), torch.ones(11), torch.full((16,), 2)]).long()
    doc_ids = torch.stack([doc, torch.zeros(40, dtype=torch.long)])
    valid = batch["attention_mask"].bool()
    doc_ids[~valid] = -1
    shift = hand_shift_labels(batch["labels"], doc_ids, valid)
    case = Case("memory", batch, batch["position_ids"], doc_ids, valid, shift)
    mask = document_causal_mask(case)
    if getattr(model.config, "sliding_window", None):
        mask = {"full_attention": mask, "sliding_attention": document_causal_mask(case, model.config.sliding_window)}
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), shift.flatten(), ignore_index=-100)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def parity_worker(rank: int, world_size: int) -> dict:
    import hf_longctx
    from hf_longctx.memory import apply_memory_flags
    from tests._models import tiny_model

    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    batch = _batch()
    results = {}
    for arch, attn, kv in MODELS[world_size]:
        model = tiny_model(arch, attn=attn, num_kv_heads=kv)
        hf_longctx.enable_sequence_parallel(model, groups)
        if arch == "llama":
            from trl.trainer.utils import add_fused_lm_head

            add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
        for name, flags in FLAGS.items():
            with apply_memory_flags(model, SimpleNamespace(**flags)):
                results[(arch, name)] = _run(model, batch, groups, fused=False)
                if arch == "llama":
                    results[(arch, name, "fused")] = _run(model, batch, groups, fused=True)
        results[(arch, "single")] = _reference(arch, attn, kv, batch)[:2]
    for backend in OTHER_BACKENDS[world_size]:
        # Fresh groups: their token layout (zigzag) follows this backend, which shard_batch reads.
        backend_groups = hf_longctx.SequenceParallelGroups.build(world_size)
        model = tiny_model("llama", attn="sdpa", num_kv_heads=2)
        hf_longctx.enable_sequence_parallel(model, backend_groups, backend=backend)
        for name in ("off", "all"):
            with apply_memory_flags(model, SimpleNamespace(**FLAGS[name])):
                results[(backend, name)] = _run(model, batch, backend_groups, fused=False)
    return results if rank == 0 else {}


def _assert_close(got, want, what: str) -> None:
    loss, grads = got[:2]
    ref_loss, ref_grads = want[:2]
    assert abs(loss.item() - ref_loss.item()) <= LOSS_RTOL * abs(ref_loss.item()), what
    for name, ref in ref_grads.items():
        err = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
        assert err <= GRAD_RTOL, f"{what} {name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_flag_matches_no_flags_and_single_device(world_size):
    results = run_distributed(parity_worker, world_size, timeout=300)[0]
    for arch, _, _ in MODELS[world_size]:
        for name in FLAGS:
            _assert_close(results[(arch, name)], results[(arch, "off")], f"SP={world_size} {arch} {name}")
        _assert_close(results[(arch, "all")], results[(arch, "single")], f"SP={world_size} {arch} all vs single")
    for backend in OTHER_BACKENDS[world_size]:
        _assert_close(results[(backend, "all")], results[(backend, "off")], f"SP={world_size} {backend} all")
        _assert_close(results[(backend, "all")], results[("llama", "single")], f"SP={world_size} {backend} vs single")
    for name in FLAGS:
        got, want = results[("llama", name, "fused")], results[("llama", "off", "fused")]
        _assert_close(got, want, f"SP={world_size} fused {name}")
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)

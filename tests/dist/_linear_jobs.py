"""Qwen3-Next and Qwen3.5 (Gated DeltaNet + gated attention) under SP: tiny models, the batches, the reference.

The reference is the plain upstream model (hf_longctx not enabled) run once per document of each row,
positions from 0, padding left out: the state of every document starts fresh, which is what a packed row
stands for. Loss = summed next-token cross entropy / number of predicted tokens, built by hand here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

import hf_longctx

VOCAB = 128
IGNORE = -100
LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5
# Per row: document lengths, then right padding up to SEQ_LEN. 151 is odd (sharding pads) and spans three
# 64-token chunks of the delta rule, so the chunk scan crosses chunks and the shard boundaries.
SEQ_LEN = 151
CASES = {
    "single": [[SEQ_LEN]],
    "padded_bs2": [[SEQ_LEN], [97]],
    "packed3": [[50, 70, 31]],
    "packed_bs2": [[60, 91], [SEQ_LEN]],
}


# Decay rates A = exp(A_log) of the test model. Upstream draws A from U(0.01, 16): per-token decays down to
# exp(-16 x softplus(...)), and the fp32 torch delta rule computes exp(cum_i - cum_j) from cumulative sums in
# the hundreds, so its own A_log / dt_bias gradients are only good to ~1e-4 (measured: fp32 vs fp64 of the
# unsharded model, 1.2e-4 of the largest entry): no fp32 run can be checked at 1e-5 on them. With A <= 1 the
# same measurement gives 4e-6, below the tolerance, so the parity test can see a real SP error there.
A_RANGE = (0.01, 1.0)


ARCHS = {"qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM), "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM)}
# Qwen3-Next only: MoE (4 experts, top 2, shared expert) on every layer. Qwen3.5 (text) has dense MLPs.
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}


def tiny_qwen3_next(seed: int = 0, key_heads: int = 4, value_heads: int = 8, arch: str = "qwen3_next"):
    """Linear, full and linear attention layers, hidden 64, float32, train mode (`arch`: see `ARCHS`)."""
    config_class, model_class = ARCHS[arch]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=512,
        use_cache=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **(_MOE if arch == "qwen3_next" else {}),
    )
    torch.manual_seed(seed)
    model = model_class._from_config(config, attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if hasattr(module, "A_log"):
            module.A_log.data = torch.empty(module.num_v_heads).uniform_(*A_RANGE, generator=gen).log()
    return model.float().train()


def make_batch(case: str) -> dict[str, torch.Tensor]:
    """The full batch a collator would hand to `shard_batch` (labels = input ids, -100 on padding)."""
    rows = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    ids = torch.randint(1, VOCAB, (len(rows), SEQ_LEN), generator=gen)
    pos = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for b, lengths in enumerate(rows):
        t = 0
        for n in lengths:
            pos[b, t : t + n], mask[b, t : t + n] = torch.arange(n), 1
            t += n
        pos[b, t:] = torch.arange(SEQ_LEN - t) + (pos[b, t - 1] + 1)
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, IGNORE)
    batch = {"input_ids": ids, "labels": labels}
    if any(len(lengths) > 1 for lengths in rows):
        batch["position_ids"] = pos
    if not bool(mask.all()):
        batch["attention_mask"] = mask
    return batch


def reference(model: torch.nn.Module, case: str, padded_len: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the plain model, one forward per document.

    The row is padded to `padded_len` as `shard_batch` pads it (token 0, mask 0 where the batch has a
    mask), and trailing padding stays attached to the row's last document, as in the SP run. It cannot
    change a real token (causal), but in float32 it moves the torch delta rule's `A_log` / `dt_bias`
    gradients by ~3e-5 of their largest entry (measured on this model): more than the tolerance, and
    nothing to do with SP.
    """
    batch = make_batch(case)
    pad = padded_len - SEQ_LEN
    ids = F.pad(batch["input_ids"], (0, pad))
    mask = batch.get("attention_mask")
    mask = None if mask is None else F.pad(mask, (0, pad))
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros(()), 0
    for b, lengths in enumerate(CASES[case]):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        for s, e in zip(starts, [*starts[1:], padded_len], strict=True):
            doc = ids[b : b + 1, s:e]
            doc_mask = None if mask is None else mask[b : b + 1, s:e]
            pos = torch.arange(e - s).unsqueeze(0)
            logits = model(input_ids=doc, position_ids=pos, attention_mask=doc_mask).logits
            real = e - s if e <= sum(lengths) else sum(lengths) - s  # tokens of the document itself
            total = total + F.cross_entropy(logits[0, : real - 1], doc[0, 1:real], reduction="sum")
            count += real - 1
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def upstream_leak(model: torch.nn.Module, case: str) -> float:
    """How far upstream's torch path on the whole packed row (position_ids restarting per document) is from
    the last document run alone: max |logits difference| / max |logits| over that document."""
    batch = make_batch(case)
    start = sum(CASES[case][0][:-1])
    with torch.no_grad():
        row = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0, start:]
        alone = model(input_ids=batch["input_ids"][:, start:]).logits[0]
    return float((row - alone).abs().max() / alone.abs().max())


def _averaged_grads(model: torch.nn.Module, groups) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        g = p.grad.detach().clone()
        dist.all_reduce(g, group=groups.sp_group)
        out[name] = g / groups.sp_world_size
    model.zero_grad(set_to_none=True)
    return out


def parity_worker(rank: int, world_size: int, combos: tuple[tuple[str, str, str, bool], ...]) -> dict:
    """Every (arch, backend, case, checkpointing) at SP=world_size: loss, averaged gradients, what ran."""
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    results = {}
    for arch, backend, case, checkpointing in combos:
        model = tiny_qwen3_next(arch=arch)
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        options = {"ulysses_degree": 2} if backend == "hybrid" else {}  # Ulysses x ring, not plain Ulysses
        with hf_longctx.enable_sequence_parallel(model, groups, backend, **options) as handle:
            shard = hf_longctx.shard_batch(make_batch(case), groups)
            shift_labels = shard.pop("shift_labels")
            loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)
            loss.backward()
            calls = (handle.attention_calls, handle.linear_calls)
            ran = (handle.backend.name, handle.backend.layout)
        patched_after = any("forward" in vars(m) for m in model.modules())
        grads = _averaged_grads(model, groups)  # a collective: every rank takes part
        results[(arch, backend, case, checkpointing)] = {
            "loss": loss.item(),
            "grads": grads if rank == 0 else None,
            "calls": calls,
            "ran": ran,
            "patched_after": patched_after,
        }
    return results


TRAINER_STEPS = 3


def run_trainer(out_dir: str, sp: int, backend: str = "ulysses") -> list[dict[str, float]]:
    """A few SGD steps of the stock `transformers.Trainer` on right-padded rows (gradient checkpointing on);
    `sp` > 1 through `ParallelismConfig`. Returns one `{step, loss, grad_norm}` per step."""
    from transformers import Trainer, TrainingArguments

    from tests.dist._trainer_utils import RecordingCollator, dataset

    parallelism = hf_longctx.ParallelismConfig(sp_size=sp, sp_backend=backend) if sp > 1 else None
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=1,
        per_device_train_batch_size=2,
        max_steps=TRAINER_STEPS,
        optim="sgd",
        learning_rate=0.1,
        max_grad_norm=0.0,  # no clipping; grad_norm is still logged
        logging_steps=1,
        save_strategy="no",
        remove_unused_columns=False,
        gradient_checkpointing=True,
        parallelism_config=parallelism,
    )
    model = tiny_qwen3_next()
    trainer = Trainer(model=model, args=args, train_dataset=dataset("mixed", 6), data_collator=RecordingCollator())
    trainer.train()
    hf_longctx.integrations.trainer.detach(trainer)
    return [
        {"step": h["step"], "loss": h["loss"], "grad_norm": h["grad_norm"]}
        for h in trainer.state.log_history
        if "loss" in h
    ]


def sp2_worker(rank: int, world_size: int, combos: tuple, out_dir: str) -> dict:
    """The parity combos, then the Trainer run at SP=world_size."""
    results = parity_worker(rank, world_size, combos)
    results["trainer"] = run_trainer(f"{out_dir}/rank{rank}", world_size)
    return results

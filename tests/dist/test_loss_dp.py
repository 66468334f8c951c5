"""The custom-loop loss contract at DP=2 x SP=2 (world 4), gradients averaged over all ranks as DDP does.

`sequence_parallel_loss(..., num_items_in_batch=N)` with N = valid tokens of BOTH DP groups' batches must
give, after the average over the 4 ranks, the single-device gradient of (sum of every token loss) / N; the
returned values summed over DP are that loss. Without N each DP group's mean counts once (plain DDP).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import hf_longctx
from hf_longctx.distributed.comm import all_reduce_sum
from tests._dist import run_distributed
from tests._models import tiny_model

IGNORE = -100
VOCAB = 128


def _batches() -> list[dict[str, torch.Tensor]]:
    """One batch per DP group, with different valid-token counts (so per-group means differ from the global)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for length, masked in ((21, 3), (26, 15)):
        ids = torch.randint(1, VOCAB, (1, length), generator=gen)
        labels = ids.clone()
        labels[0, :masked] = IGNORE
        out.append({"input_ids": ids, "labels": labels})
    return out


def _reference(contract: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    sums, counts = [], []
    for batch in _batches():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
        target = batch["labels"][:, 1:]
        sums.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum"))
        counts.append(int((target != IGNORE).sum()))
    if contract == "global":
        loss = sum(sums) / sum(counts)
    else:  # DDP over two DP groups, each with its own mean
        loss = sum(s / n for s, n in zip(sums, counts, strict=True)) / len(sums)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int) -> dict:
    groups = hf_longctx.SequenceParallelGroups.build(sp_size=2)
    return {contract: _run(contract, groups, world_size) for contract in ("global", "per_group")}


def _run(contract: str, groups: hf_longctx.SequenceParallelGroups, world_size: int) -> dict:
    batches = _batches()
    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    with hf_longctx.enable_sequence_parallel(model, groups):
        shard = hf_longctx.shard_batch(batches[groups.dp_rank], groups)
        shift_labels = shard.pop("shift_labels")
        n = None
        if contract == "global":
            local = (shift_labels != IGNORE).sum()
            n = all_reduce_sum(all_reduce_sum(local, groups.sp_group), groups.dp_group)
        loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups, num_items_in_batch=n)
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = all_reduce_sum(p.grad, None if world_size == 1 else torch.distributed.group.WORLD) / world_size
    logged = all_reduce_sum(loss.detach(), groups.dp_group)  # the SP groups' parts of the loss
    return {"loss": logged.item(), "grads": grads, "ref": _reference(contract)}


_results: list = []


def _check(contract: str) -> None:
    if not _results:
        _results.append(run_distributed(_worker, 4, timeout=240))
    results = [r[contract] for r in _results[0]]
    ref_loss, ref_grads = results[0]["ref"]
    for result in results:
        if contract == "global":
            assert abs(result["loss"] - ref_loss) <= 1e-6 * abs(ref_loss), (result["loss"], ref_loss)
        for name, want in ref_grads.items():
            err = (result["grads"][name] - want).abs().max() / want.abs().max()
            assert err <= 1e-5, f"{contract} {name}: {err:.2e}"


def test_global_token_count_gives_single_device_gradient_at_dp2_sp2():
    _check("global")


def test_without_count_each_dp_group_mean_counts_once():
    _check("per_group")

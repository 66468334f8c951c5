"""Token-classification and extractive-QA heads, and PEFT adapters that touch the loss, are exact under SP.

Library level (`enable_sequence_parallel` + `shard_batch`, the model's own forward): the loss and every parameter's
gradient averaged over the SP group (what a data-parallel engine does) equal the plain model in one process, at SP=2
and 4, Ulysses and ring, on padded, packed and QA batches whose answers sit on either side of the shard boundaries.
Before hf_longctx knew these heads (26f0ae5) token classification trained on the next token's tag and QA took the
softmax over each rank's shard with global answer indices read as local ones; AdaLoRA's orthogonal regulariser was
added by every rank (P times), and on a token-classification or QA head not at all (the head's loss is computed
after PEFT's forward); PEFT's QA wrapper dropped `position_ids`; LLaMA-Adapter is exact as is (a guard).

Through the stock `Trainer` (SP=2 on 2 processes against plain DDP on the same 2 processes, which is what a user
compares with): per-step loss and grad_norm, and the evaluation loss. The generic token-classification head
averages over each process's own tokens and Trainer multiplies every process's loss by the number of processes,
so both runs are 2x the one-process loss (upstream, documented); rows carry equally many tags so the DDP ranks'
means are comparable.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests.dist import _task_heads as H

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
CASES = {
    2: [
        ("llama", "token", "ulysses"),
        ("mistral", "qa", "ring"),
        ("llama", "adalora", "ulysses"),
        ("llama", "adalora-token", "ulysses"),
        ("llama", "adalora-qa", "ring"),
    ],
    4: [("qwen3", "token", "ring"), ("llama", "qa", "ulysses"), ("llama", "adaption", "ring")],
}


def _build(arch: str, kind: str) -> torch.nn.Module:
    if kind in ("token", "qa"):
        return H.task_model(arch, kind)
    adapter, _, head = kind.partition("-")  # "adalora-token": AdaLoRA on a token-classification head
    return H.adapter_model(adapter, head or "causal")


def _head(kind: str) -> str:
    return kind.rpartition("-")[2]


def _batches(kind: str) -> list[dict[str, torch.Tensor]]:
    return {"token": H.token_batches, "qa": H.qa_batches}.get(_head(kind), H.causal_batches)()


def _steps(model: torch.nn.Module, kind: str, groups=None) -> list[tuple[float, list[torch.Tensor]]]:
    """(loss, gradients) per batch of `kind`, under SP combined over the group. Next-token batches get the global
    label count as `num_items_in_batch` and, under SP, their shifted labels as `labels` (as the Trainer passes them):
    each rank's loss is its share of the token mean, so shares and gradients are summed. A head's loss is P x its
    share (token classification: what plain DDP gives) or whole with a P x share gradient (QA), so both are averaged,
    as a data-parallel engine averages gradients."""
    import torch.distributed as dist

    import hf_longctx
    from hf_longctx.data.sharding import document_positions, make_shift_labels

    out = []
    for batch in _batches(kind):
        model.zero_grad()
        inputs = dict(batch if groups is None else hf_longctx.shard_batch(batch, groups))
        if _head(kind) not in ("token", "qa"):
            ids = batch["input_ids"]
            positions = document_positions(batch, ids.shape[0], ids.shape[1], ids.device)
            shifted = make_shift_labels(batch["labels"], positions, batch.get("attention_mask"))
            inputs["num_items_in_batch"] = int((shifted != H.IGNORE).sum())
            if groups is not None:
                inputs["labels"] = inputs["shift_labels"]  # and shift_labels stays: the loss must not shift again
        loss = model(**inputs).loss
        loss.backward()
        values = [loss.detach().reshape(1).clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
        if groups is not None:
            for t in values:
                dist.all_reduce(t, group=groups.sp_group)
                if _head(kind) in ("token", "qa"):
                    t /= groups.sp_world_size
        out.append((float(values[0]), values[1:]))
    return out


def _library_worker(rank: int, world_size: int, cases: list[tuple[str, str, str]]) -> dict:
    import hf_longctx
    from hf_longctx.distributed.groups import SequenceParallelGroups

    groups = SequenceParallelGroups.build(world_size)
    results = {}
    for arch, kind, backend in cases:
        model = _build(arch, kind)
        with hf_longctx.enable_sequence_parallel(model, groups, backend=backend):
            results[(arch, kind, backend)] = _steps(model, kind, groups)
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_library_loss_and_every_gradient_match_one_process(world_size: int) -> None:
    got = run_distributed(_library_worker, world_size, CASES[world_size], timeout=300)
    for case in CASES[world_size]:
        arch, kind, _ = case
        expected = _steps(_build(arch, kind), kind)
        for rank_results in got:
            for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(
                zip(rank_results[case], expected, strict=True)
            ):
                where = f"{case} step {step}"
                assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (where, loss, ref_loss)
                # QA's position logits are shift-invariant, so the bias of `qa_outputs` has a zero gradient: where the
                # reference is round-off, SP's must be too (1e-5 of the model's largest gradient); elsewhere each
                # parameter is compared relative to its own largest gradient.
                top = max(float(ref.abs().max()) for ref in ref_grads)
                for i, (g, ref) in enumerate(zip(grads, ref_grads, strict=True)):
                    scale = ref.abs().max() if ref.abs().max() > 1e-6 * top else torch.tensor(top)
                    assert (g - ref).abs().max() <= GRAD_RTOL * scale, (where, i, float((g - ref).abs().max() / scale))


def test_trainer_per_step_matches_plain_ddp(tmp_path) -> None:
    from tests.dist._trainer_utils import compare_logs, rel_diff

    results = run_distributed(H.trainer_worker, 2, str(tmp_path), timeout=300)
    for head in ("token", "qa"):
        for rank_results in results:
            got, want = rank_results[2][head], rank_results[1][head]
            assert got["attn"].startswith("hf_longctx_ulysses") and want["attn"] == "sdpa", (got["attn"], want["attn"])
            compare_logs(got["logs"], want["logs"], ("loss", "grad_norm"), 1e-5)
            assert rel_diff(got["eval_loss"], want["eval_loss"]) <= 1e-5, (head, got, want)

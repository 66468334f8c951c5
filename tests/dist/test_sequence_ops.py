"""What a model computes over the whole sequence outside attention is exact under SP (`hf_longctx.sequence`).

Each case runs the library path (`enable_sequence_parallel`, `shard_batch`, the model's own loss with
`num_items_in_batch`) at SP=2 or SP=4 and compares with the plain model in one process on the same batches: the
summed loss shares, `aux_loss` (whole on every rank) and every parameter's summed gradient. The batches hold a
right-padded row and a length that needs SP padding; packed rows restart their positions.

- MoE router load-balancing loss, every family that builds from the tiny recipe and that SP serves;
- run-time RoPE: dynamic NTK and longrope, over a long batch then a short one (their state resets), single and
  packed documents;
- Llama 4's attention temperature on its no-RoPE layer, Ulysses and ring;
- Ministral 3's query scale from `position_ids`, exact as is (a guard against a change that would break it).
Each fails on f1bc042 (before hf_longctx.sequence): shard-local statistics, lengths and indices.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests._moe_models import REFUSED_MIXERS, UNBUILT, router_loss_families

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
SP_MOE = [f for f in router_loss_families() if f not in UNBUILT and f not in REFUSED_MIXERS]


def _batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """ "padded": rows of 37 tokens, the second right-padded after 29; "packed": one row of documents of 20 and 17
    tokens; "long_short": a 37-token row (past the 32 / 16 native positions) then a 12-token one."""
    g = torch.Generator().manual_seed(7)

    def row(n: int, bs: int = 1) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 128, (bs, n), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}

    if kind == "padded":
        batch = row(37, 2)
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        batch["attention_mask"][1, 29:] = 0
        batch["labels"][1, 29:] = -100
        return [batch]
    if kind == "packed":
        batch = row(37)
        batch["position_ids"] = torch.cat([torch.arange(20), torch.arange(17)]).unsqueeze(0)
        batch["labels"][0, 20] = -100  # no loss across the boundary (as DataCollatorWithFlattening marks it)
        return [batch]
    return [row(37), row(12)]


def _count(batch: dict[str, torch.Tensor]) -> int:
    from hf_longctx.data.sharding import document_positions, make_shift_labels

    ids = batch["input_ids"]
    positions = document_positions(batch, ids.shape[0], ids.shape[1], ids.device)
    return int((make_shift_labels(batch["labels"], positions, batch.get("attention_mask")) != -100).sum())


def _steps(model, batches, groups=None) -> list[tuple[float, float | None, list[torch.Tensor]]]:
    """(loss, aux_loss, gradients) per batch; under SP the loss shares and gradients summed over the group."""
    import torch.distributed as dist

    import hf_longctx

    out = []
    for batch in batches:
        model.zero_grad()
        n = _count(batch)
        if groups is None:
            result = model(**batch, num_items_in_batch=n)
        else:
            shard = hf_longctx.shard_batch(batch, groups)
            shard["labels"] = shard["shift_labels"]  # pre-shifted on the full row, as the Trainer collator passes it
            result = model(**shard, num_items_in_batch=n)
        result.loss.backward()
        loss = result.loss.detach().reshape(1).clone()
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
        if groups is not None:
            for t in (loss, *grads):
                dist.all_reduce(t, group=groups.sp_group)
        aux = getattr(result, "aux_loss", None)
        out.append((float(loss), None if aux is None else float(aux.detach()), grads))
    return out


def _worker(rank: int, world_size: int, cases: list[tuple[str, str, str]]) -> dict:
    import hf_longctx
    from hf_longctx.distributed.groups import SequenceParallelGroups
    from tests._sequence_models import sequence_model

    groups = SequenceParallelGroups.build(world_size)
    results = {}
    for model_kind, backend, batch_kind in cases:
        model = sequence_model(model_kind)
        with hf_longctx.enable_sequence_parallel(model, groups, backend=backend):
            results[(model_kind, backend, batch_kind)] = _steps(model, _batches(batch_kind), groups)
    return results


def _check(cases: list[tuple[str, str, str]], world_size: int) -> None:
    from tests._sequence_models import sequence_model

    got = run_distributed(_worker, world_size, cases, timeout=600)
    for case in cases:
        model_kind, _, batch_kind = case
        expected = _steps(sequence_model(model_kind), _batches(batch_kind))
        for rank_results in got:
            for step, ((loss, aux, grads), (ref_loss, ref_aux, ref_grads)) in enumerate(
                zip(rank_results[case], expected, strict=True)
            ):
                where = f"{case} step {step}"
                assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (where, loss, ref_loss)
                assert (aux is None) == (ref_aux is None), where
                if aux is not None:
                    assert abs(aux - ref_aux) <= LOSS_RTOL * abs(ref_aux), (where, aux, ref_aux)
                for i, (g, ref) in enumerate(zip(grads, ref_grads, strict=True)):
                    scale = ref.abs().max().clamp(min=1e-12)
                    assert (g - ref).abs().max() <= GRAD_RTOL * scale, (where, i, float((g - ref).abs().max() / scale))


def test_router_loss_every_family_sp2():
    assert len(SP_MOE) >= 15
    _check([(f"moe:{f}", "ulysses", "padded") for f in SP_MOE], 2)


@pytest.mark.slow
def test_router_loss_sp4_packed_and_ring():
    # gpt-oss runs eager, where transformers' own packed rows attend across documents: padded rows only.
    cases = [("moe:qwen3_moe", "ulysses", "packed"), ("moe:gpt_oss", "ulysses", "padded")]
    cases += [("moe:mixtral", "ring", "padded"), ("moe:qwen3_moe", "ring", "packed")]
    _check(cases, 4)


def test_runtime_rope_and_temperature_sp2():
    cases = [(kind, "ulysses", batches) for kind in ("dynamic", "longrope") for batches in ("long_short", "packed")]
    cases += [("temperature", backend, "padded") for backend in ("ulysses", "ring")]
    # Exact as is: Ministral 3 scales queries from the (global) position ids the attention is given.
    cases += [("position_scale", backend, "packed") for backend in ("ulysses", "ring")]
    _check(cases, 2)


@pytest.mark.slow
def test_runtime_rope_and_temperature_sp4():
    cases = [("dynamic", "ring", "long_short"), ("longrope", "ulysses", "long_short")]
    cases += [("temperature", "ring", "packed"), ("temperature", "ulysses", "padded")]
    _check(cases, 4)


def _trl_router_loss_worker(rank: int, world_size: int) -> str:
    import hf_longctx
    from hf_longctx.distributed.groups import SequenceParallelGroups
    from tests._sequence_models import sequence_model

    groups = SequenceParallelGroups.build(world_size)
    model = sequence_model("temperature")  # Llama 4: router logits recorded, no router loss in its forward
    with hf_longctx.enable_sequence_parallel(model, groups):
        shard = hf_longctx.shard_batch(_batches("padded")[0], groups)
        try:
            model(**shard, fused_lm_head=True, output_router_logits=True)  # what TRL's fused head is called with
        except ValueError as err:
            return str(err)
    return "no error"


def test_trl_router_loss_on_a_model_without_one_is_refused():
    """TRL's fused head adds Mixtral's router loss to any model with `output_router_logits` and a non-zero
    coefficient (Llama 4's config has 0.001): under SP it would take each shard's router logits alone."""
    for message in run_distributed(_trl_router_loss_worker, 2, timeout=120):
        assert "router_aux_loss_coef=0.0" in message, message


def _alibi_worker(rank: int, world_size: int) -> str:
    from transformers import BloomConfig, BloomForCausalLM

    import hf_longctx
    from hf_longctx.distributed.groups import SequenceParallelGroups

    groups = SequenceParallelGroups.build(world_size)
    model = BloomForCausalLM(BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4))
    with hf_longctx.enable_sequence_parallel(model, groups):
        try:
            model(**hf_longctx.shard_batch(_batches("padded")[0], groups))
        except (ValueError, TypeError) as err:
            return f"{type(err).__name__}: {err}"
    return "no error"


def test_attention_outside_the_interface_is_refused_at_the_first_step():
    """Bloom builds ALiBi from the key length it is given and computes attention itself (not through transformers'
    attention interface): refused at the first forward, never trained on shards."""
    for message in run_distributed(_alibi_worker, 2, timeout=120):
        assert message.startswith("ValueError") and "attention interface" in message, message

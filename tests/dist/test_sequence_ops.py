"""What a model computes over the whole sequence outside attention is exact under SP (`hf_longctx.sequence`).

Each case runs the library path (`enable_sequence_parallel`, `shard_batch`, the model's own loss with
`num_items_in_batch`) at SP=2 or SP=4 and compares with the plain model in one process on the same batches: the
summed loss shares, `aux_loss` (whole on every rank) and every parameter's summed gradient. The batches hold a
right-padded row and a length that needs SP padding; packed rows restart their positions.

- MoE router load-balancing loss, every family that builds from the tiny recipe and that SP serves;
- run-time RoPE: dynamic NTK and longrope, over a long batch then a short one (their state resets);
- packed rows of documents longer and shorter than the native length, and Llama 4's attention temperature: against
  each document run alone through the plain model (in row order, the same token weighting), also at SP=1 (one
  rank still serves attention, RoPE and temperature per document); Ulysses and ring;
- Ministral 3's query scale from `position_ids`, exact as is (a guard against a change that would break it).
Each fails on f1bc042 (before hf_longctx.sequence): shard-local statistics, lengths and indices; the packed
documents fail before per-document RoPE and temperature (the batch's longest document, the index in the row).
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed
from tests._moe_models import REFUSED_MIXERS, UNBUILT, router_loss_families

LOSS_RTOL, GRAD_RTOL = 1e-6, 1e-5
SP_MOE = [f for f in router_loss_families() if f not in UNBUILT and f not in REFUSED_MIXERS]


def _packed(g: torch.Generator, rows: list[list[int]], pad: int = 0) -> dict[str, torch.Tensor]:
    """Rows of documents restarting their positions; with `pad`, the first row ends in `pad` padding tokens whose
    positions are 0 (as TRL's collator pads `position_ids`), masked out by an attention mask."""
    positions = torch.stack([torch.cat([torch.arange(n) for n in row] + [torch.zeros(pad * (i == 0), dtype=torch.long)])
                             for i, row in enumerate(rows)])  # fmt: skip
    ids = torch.randint(1, 128, positions.shape, generator=g)
    labels = ids.masked_fill((positions == 0) & (torch.arange(positions.shape[1]) > 0), -100)  # no loss across
    batch = {"input_ids": ids, "labels": labels, "position_ids": positions}
    if pad:
        batch["attention_mask"] = torch.ones_like(ids)
        batch["attention_mask"][0, -pad:] = 0
    return batch


def _batches(kind: str) -> list[dict[str, torch.Tensor]]:
    """ "padded": rows of 37 tokens, the second right-padded after 29; "packed": one row of documents of 20 and 17
    tokens; "long_short": a 37-token row (past the 32 / 16 native positions), a 30-token one (past longrope's 16
    while each SP=2 shard holds 15 positions at most: the first rank's alone would keep the short factors), then a
    12-token one; "docs": packed
    documents of 40, 36, 20 and 35 tokens (dynamic NTK, 32 native positions: grows, keeps, resets and grows again;
    longrope's 16 native positions are crossed by all), then rows of 36 + 5 padding and 35 + 6 (35 keeps 36's
    frequencies: the padding resets nothing; 6 is short); "unpacked": rows of 34 + 6 padding (positions 0) and 40
    (every row gets the batch's longest row's frequencies, as the run without SP gives them)."""
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
    if kind == "packed":  # no loss across the boundary (as DataCollatorWithFlattening marks it)
        return [_packed(g, [[20, 17]])]
    if kind == "docs":
        return [_packed(g, [[40, 36, 20, 35]]), _packed(g, [[36], [35, 6]], pad=5)]
    if kind == "unpacked":
        return [_packed(g, [[34], [40]], pad=6)]
    return [row(37), row(30), row(12)]


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
        if groups is not None and groups.sp_enabled:
            for t in (loss, *grads):
                dist.all_reduce(t, group=groups.sp_group)
        aux = getattr(result, "aux_loss", None)
        out.append((float(loss), None if aux is None else float(aux.detach()), grads))
    return out


def _document_steps(model, batches) -> list[tuple[float, None, list[torch.Tensor]]]:
    """The packed rows' reference: each document alone through the plain model, row after row in order, with the
    batch's token count (the same weighting as the packed loss)."""
    from hf_longctx.data.sharding import document_starts

    out = []
    for batch in batches:
        model.zero_grad()
        n, loss = _count(batch), 0.0
        masks = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
        for ids, labels, positions, mask in zip(
            batch["input_ids"], batch["labels"], batch["position_ids"], masks, strict=True
        ):
            real = int(mask.sum())  # right padding: no document of its own
            bounds = [*torch.nonzero(document_starts(positions[None, :real])[0]).flatten().tolist(), real]
            for start, end in zip(bounds[:-1], bounds[1:], strict=True):
                result = model(input_ids=ids[None, start:end], labels=labels[None, start:end], num_items_in_batch=n)
                result.loss.backward()
                loss += float(result.loss.detach())
        out.append(
            (loss, None, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
        )
    return out


def _reference(model_kind: str, batch_kind: str):
    from tests._sequence_models import sequence_model

    model = sequence_model(model_kind)
    return _document_steps(model, _batches(batch_kind)) if batch_kind == "docs" else _steps(model, _batches(batch_kind))


def _single_rank(model_kind: str, batch_kind: str):
    """hf_longctx on one rank (what sp_size=1 attaches): attention, RoPE and temperature per document."""
    import hf_longctx
    from tests._sequence_models import sequence_model

    groups = hf_longctx.SequenceParallelGroups.single()
    model = sequence_model(model_kind)
    with hf_longctx.enable_sequence_parallel(model, groups):
        return _steps(model, _batches(batch_kind), groups)


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


def _compare(where: str, got, expected) -> None:
    for step, ((loss, aux, grads), (ref_loss, ref_aux, ref_grads)) in enumerate(zip(got, expected, strict=True)):
        at = f"{where} step {step}"
        assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (at, loss, ref_loss)
        assert (aux is None) == (ref_aux is None), at
        if aux is not None:
            assert abs(aux - ref_aux) <= LOSS_RTOL * abs(ref_aux), (at, aux, ref_aux)
        for i, (g, ref) in enumerate(zip(grads, ref_grads, strict=True)):
            scale = ref.abs().max().clamp(min=1e-12)
            assert (g - ref).abs().max() <= GRAD_RTOL * scale, (at, i, float((g - ref).abs().max() / scale))


def _check(cases: list[tuple[str, str, str]], world_size: int, single_rank: bool = False) -> None:
    """Every case at SP=`world_size` against its reference; with `single_rank`, the "docs" cases on one rank too."""
    got = run_distributed(_worker, world_size, cases, timeout=600)
    for case in cases:
        expected = _reference(case[0], case[2])
        if single_rank and case[2] == "docs" and case[1] == "ulysses":  # one rank: once per model
            _compare(f"{case} at SP=1", _single_rank(case[0], case[2]), expected)
        for rank_results in got:
            _compare(str(case), rank_results[case], expected)


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
    cases = [(kind, "ulysses", batches) for kind in ("dynamic", "longrope") for batches in ("long_short", "docs")]
    cases += [("temperature", backend, "padded") for backend in ("ulysses", "ring")]
    cases += [("temperature", "ulysses", "docs"), ("dynamic", "ring", "docs"), ("dynamic", "ulysses", "unpacked")]
    # Exact as is: Ministral 3 scales queries from the (global) position ids the attention is given.
    cases += [("position_scale", backend, "packed") for backend in ("ulysses", "ring")]
    _check(cases, 2, single_rank=True)


@pytest.mark.slow
def test_runtime_rope_and_temperature_sp4():
    cases = [("dynamic", "ring", "long_short"), ("dynamic", "ulysses", "docs"), ("longrope", "ring", "docs")]
    cases += [("temperature", "ring", "docs"), ("temperature", "ulysses", "padded")]
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

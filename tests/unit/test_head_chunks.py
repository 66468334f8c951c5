"""`ulysses_head_chunks`: validation (config, model check), the chunk plans, and the planner's model of it."""

from __future__ import annotations

import pytest

from hf_longctx import ParallelismConfig
from hf_longctx.attention.head_chunks import head_chunks, valid_head_chunks
from hf_longctx.attention.registry import check_model
from hf_longctx.attention.ulysses import head_layout
from tests._models import tiny_model


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"sp_size": 2, "ulysses_head_chunks": 0}, "integer >= 1"),
        ({"sp_size": 2, "ulysses_head_chunks": -2}, "integer >= 1"),
        ({"sp_size": 2, "ulysses_head_chunks": True}, "integer >= 1"),
        ({"sp_size": 2, "ulysses_head_chunks": "2"}, "integer >= 1"),
        ({"sp_size": 2, "sp_backend": "ring", "ulysses_head_chunks": 2}, "sp_backend='ulysses'"),
        ({"sp_size": 2, "sp_backend": "auto", "ulysses_head_chunks": 2}, "sp_backend='ulysses'"),
        ({"sp_size": 2, "sp_backend": "deepspeed", "ulysses_head_chunks": 2}, "sp_backend='ulysses'"),
        ({"sp_size": 1, "ulysses_head_chunks": 2}, "sp_size > 1"),
    ],
)
def test_bad_head_chunks_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        ParallelismConfig(**kwargs)
    assert "ulysses_head_chunks" in str(info.value)


def test_head_chunks_reach_enable_sequence_parallel():
    config = ParallelismConfig(sp_size=2, ulysses_head_chunks=4)
    assert config.attention_options()["ulysses_head_chunks"] == 4
    assert ParallelismConfig(sp_size=2).attention_options()["ulysses_head_chunks"] == 1


@pytest.mark.parametrize(
    "heads,kv_heads,sp,valid",
    [
        (8, 4, 2, [1, 2]),  # 2 kv heads per rank: whole groups of 2 query heads
        (32, 8, 2, [1, 2, 4]),  # Llama-3.1-8B at SP=2
        (32, 8, 8, [1, 2, 4]),  # one kv head per rank: chunks of its 4 query heads
        (4, 4, 2, [1, 2]),  # MHA
        (4, 1, 2, [1, 2]),  # MQA: the one kv head goes with every chunk
        (12, 3, 2, [1, 2, 3, 6]),  # irregular: a kv copy per local query head
    ],
)
def test_valid_counts_keep_whole_query_groups(heads, kv_heads, sp, valid):
    assert valid_head_chunks(heads, kv_heads, sp) == valid
    full = head_layout(heads, kv_heads, sp)
    for chunks in valid:
        plans = head_chunks(heads, kv_heads, sp, chunks)
        # Every rank's query heads are covered exactly once, chunk by chunk.
        local = [range(plan.offset, plan.offset + plan.layout.q_local) for plan in plans]
        assert sorted(h for heads_ in local for h in heads_) == list(range(full.q_local))
        for plan in plans:
            assert plan.layout.q_local * chunks == full.q_local
            for r in range(sp):
                q = [r * full.q_local + h for h in range(plan.offset, plan.offset + plan.layout.q_local)]
                kv = plan.kv_index[r * plan.layout.kv_local : (r + 1) * plan.layout.kv_local]
                # Local query head i reads local kv head i // group, and that is the model's kv head of it.
                group = plan.layout.kv_groups_local
                assert [kv[i // group] for i in range(len(q))] == [h // (heads // kv_heads) for h in q]


def test_check_model_lists_valid_counts():
    model = tiny_model("llama", num_heads=8, num_kv_heads=4, hidden=128)
    assert check_model(model, 2, ulysses_head_chunks=2).name == "ulysses"
    with pytest.raises(ValueError, match=r"ulysses_head_chunks=3 .* one of \[1, 2\]"):
        check_model(model, 2, ulysses_head_chunks=3)
    with pytest.raises(ValueError, match="sp_backend='ulysses'"):
        check_model(model, 2, "hybrid", ulysses_head_chunks=2)


def _attention_inputs(heads: int, kv_heads: int, seq: int = 24, dim: int = 16):
    import torch

    from hf_longctx.attention.kernels import SequenceContext

    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, n, seq, dim, generator=gen, requires_grad=True) for n in (heads, kv_heads, kv_heads)]
    # Two packed documents: the chunks must keep them apart as plain Ulysses does.
    context = SequenceContext(torch.cat([torch.arange(10), torch.arange(seq - 10)]).unsqueeze(0))
    return leaves, context


@pytest.mark.parametrize("heads,kv_heads,chunks", [(8, 4, 2), (8, 4, 4), (4, 1, 4), (6, 6, 3)])
def test_chunked_attention_equals_plain_on_one_rank(heads, kv_heads, chunks):
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_longctx import SequenceParallelGroups
    from hf_longctx.attention.head_chunks import head_chunked_attention
    from hf_longctx.attention.ulysses import ulysses_attention

    module = tiny_model("llama", num_heads=heads, num_kv_heads=kv_heads, hidden=16 * heads).model.layers[0].self_attn
    leaves, context = _attention_inputs(heads, kv_heads)
    call = {"kernel": ALL_ATTENTION_FUNCTIONS["sdpa"], "kernel_name": "sdpa", "family": "sdpa"}
    call.update(context=context, groups=SequenceParallelGroups.single(), dropout=0.0, scaling=0.25)
    results = []
    for run in (lambda q, k, v: ulysses_attention(module, q, k, v, **call)[0],
                lambda q, k, v: head_chunked_attention(module, q, k, v, chunks=chunks, **call)[0]):  # fmt: skip
        out = run(*(t * 1.0 for t in leaves))
        out.backward(torch.ones_like(out) + out.detach())
        results.append((out.detach(), [t.grad.clone() for t in leaves]))
        for t in leaves:
            t.grad = None
    (plain, plain_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(chunked_grads, plain_grads, strict=True):
        assert want.abs().max() > 0
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attention dropout"):
        head_chunked_attention(module, *leaves, chunks=chunks, **{**call, "dropout": 0.1})


# ---- the planner's model of the option ---------------------------------------------------------------


def _planner():
    from hf_longctx.planner import DEVICES, RunConfig, estimate
    from hf_longctx.planner.model_shape import load_model_shape
    from hf_longctx.planner.terms import head_chunk_kv, layer_bytes
    from hf_longctx.planner.terms import valid_head_chunks as planner_valid

    return DEVICES, RunConfig, estimate, load_model_shape, head_chunk_kv, layer_bytes, planner_valid


@pytest.mark.parametrize("name", ["llama3.1-8b", "qwen3-4b"])
@pytest.mark.parametrize("sp", [2, 4, 8])
def test_planner_head_chunks_follow_the_implementation(name, sp):
    _, _, _, load_model_shape, head_chunk_kv, _, planner_valid = _planner()
    shape = load_model_shape(name)
    valid = valid_head_chunks(shape.heads, shape.kv_heads, sp)
    assert planner_valid(shape, sp) == valid and len(valid) > 1
    for chunks in valid:
        plan = head_chunks(shape.heads, shape.kv_heads, sp, chunks)[0]
        assert head_chunk_kv(shape, sp, chunks) == plan.layout.kv_local


def test_planner_terms_with_head_chunks():
    devices, RunConfig, estimate, load_model_shape, _, layer_bytes, _ = _planner()
    shape = load_model_shape("llama3.1-8b")
    flags = {"gradient_checkpointing": True, "tiled_loss": True, "tiled_mlp": True, "engine": "zero3"}
    base = RunConfig(seq_len=2**20, world=8, sp=8, **flags)
    tokens = base.seq_len // base.sp
    plain = layer_bytes(shape, base, tokens, on_cpu=False)
    # chunks = 1 is the unchunked model, term for term.
    assert layer_bytes(shape, RunConfig(**{**base.__dict__, "ulysses_head_chunks": 1}), tokens, False) == plain
    a, d = base.act_bytes, shape.head_dim
    qkv = a * tokens * d * (shape.heads + 2 * 8 * 1)  # one kv head per rank at SP=8
    assert plain.all_to_all == qkv
    previous = plain
    for chunks in (2, 4):
        layer = layer_bytes(shape, RunConfig(**{**base.__dict__, "ulysses_head_chunks": chunks}), tokens, False)
        # The exchange buffer: the chunk's query heads, and the one kv head each chunk sends again.
        assert layer.all_to_all == a * tokens * d * (shape.heads // chunks + 2 * 8)
        # Saved (the recompute, under checkpointing): sequence-sharded q/k/v instead of the kernel's q/k/v, output
        # and log-sum-exp, whatever the count; backward: the whole q/k/v gradient but one chunk's kernel terms.
        expected = plain.saved - (qkv + 4 * tokens * shape.heads + a * tokens * shape.heads * d)
        assert layer.saved == expected + a * tokens * d * (shape.heads + 2 * shape.kv_heads)
        total = lambda b: b.saved + b.backward + b.all_to_all  # noqa: E731 - the backward phase's layer terms
        assert total(layer) < total(previous)
        previous = layer
    peaks = [
        estimate(shape, RunConfig(**{**base.__dict__, "ulysses_head_chunks": c}), devices["h100"]).peak_gib
        for c in (1, 2, 4)
    ]
    assert peaks[0] > peaks[1] > peaks[2]


def test_planner_refuses_bad_head_chunks():
    devices, RunConfig, estimate, load_model_shape, _, _, _ = _planner()
    shape = load_model_shape("llama3.1-8b")
    with pytest.raises(ValueError, match=r"valid: \[1, 2, 4\]"):
        estimate(shape, RunConfig(seq_len=8192, world=8, sp=8, ulysses_head_chunks=3), devices["h100"])
    with pytest.raises(ValueError, match="--sp > 1"):
        RunConfig(seq_len=8192, ulysses_head_chunks=2)
    with pytest.raises(ValueError, match="integer >= 1"):
        RunConfig(seq_len=8192, sp=2, world=2, ulysses_head_chunks=0)


def test_plan_cli_takes_head_chunks(capsys):
    import json

    from hf_longctx.cli import main

    argv = ["plan", "--model", "llama3.1-8b", "--seq-len", "1048576", "--world", "8", "--sp", "8"]
    argv += ["--gradient-checkpointing", "--tiled-loss", "--tiled-mlp", "--engine", "zero3"]
    main([*argv, "--json"])
    plain = json.loads(capsys.readouterr().out)
    main([*argv, "--ulysses-head-chunks", "4", "--json"])
    chunked = json.loads(capsys.readouterr().out)
    assert chunked["run"]["ulysses_head_chunks"] == 4 and plain["run"]["ulysses_head_chunks"] == 1
    assert chunked["peak_gib"] < plain["peak_gib"]
    main([*argv, "--ulysses-head-chunks", "4"])
    assert "4 Ulysses head chunks" in capsys.readouterr().out
    assert main([*argv, "--ulysses-head-chunks", "3"]) == 2
    assert "valid: [1, 2, 4]" in capsys.readouterr().err

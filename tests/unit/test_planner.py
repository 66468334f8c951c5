"""The memory planner as a pure function: shapes, model states, activation terms, flags, bisection.

References are computed independently in each test: parameter counts from real transformers models
(built on the meta device), saved-activation bytes from autograd's own saved tensors of a tiny model
(`saved_tensors_hooks`), and closed forms written out here for the simple terms.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_longctx.planner import (
    DEVICES,
    GIB,
    TERMS,
    RunConfig,
    estimate,
    max_seq_len,
    model_state_bytes,
)
from hf_longctx.planner.model_shape import ModelShape, load_model_shape, shipped_model_names
from hf_longctx.planner.terms import layer_bytes, loss_bytes, norm_bytes

ROOT = Path(__file__).resolve().parents[2]
H100, CPU = DEVICES["h100"], DEVICES["cpu"].with_capacity(1e6)
LLAMA = load_model_shape("llama3.1-8b")
QWEN = load_model_shape("qwen3-4b")
TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 320,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}


def _meta_params(model_cls, config) -> int:
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


# ---- model shapes --------------------------------------------------------------------------------


def test_shipped_names_are_the_recipe_models():
    assert {"llama3.1-8b", "qwen3-4b"} <= set(shipped_model_names())


@pytest.mark.parametrize("name", ["llama3.1-8b", "qwen3-4b"])
def test_shipped_config_parameter_count_matches_transformers(name):
    from importlib.resources import files

    raw = json.loads((files("hf_longctx") / "data" / "model_configs" / f"{name}.json").read_text())
    config = AutoConfig.for_model(**raw)
    assert load_model_shape(name).num_params() == _meta_params(AutoModelForCausalLM.from_config, config)


@pytest.mark.parametrize(
    "model_cls, config",
    [
        (LlamaForCausalLM, LlamaConfig(**TINY)),
        (LlamaForCausalLM, LlamaConfig(**{**TINY, "attention_bias": True, "mlp_bias": True})),
        (Qwen3ForCausalLM, Qwen3Config(**{**TINY, "tie_word_embeddings": True})),
        (MixtralForCausalLM, MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)),
    ],
    ids=["llama", "llama-bias", "qwen3-tied", "mixtral"],
)
def test_parameter_count_matches_transformers(model_cls, config):
    shape = ModelShape.from_config(config.to_dict())
    assert shape.num_params() == _meta_params(model_cls, config)


def test_load_model_shape_from_file_and_folder(tmp_path):
    config = LlamaConfig(**TINY).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_file = load_model_shape(str(tmp_path / "config.json"))
    from_dir = load_model_shape(str(tmp_path))
    assert from_file.num_params() == from_dir.num_params() == _meta_params(LlamaForCausalLM, LlamaConfig(**TINY))
    nested = {"model_type": "llava", "text_config": config}
    assert ModelShape.from_config(nested).hidden == TINY["hidden_size"]


def test_unknown_model_names_the_shipped_ones():
    with pytest.raises(ValueError, match="llama3.1-8b"):
        load_model_shape("no-such-model")
    with pytest.raises(ValueError, match="vocab_size"):
        ModelShape.from_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})


# ---- activation formulas against autograd's saved tensors ----------------------------------------


def _saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in a forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layer_saved_bytes_match_autograd(arch, dtype, attn):
    """Without checkpointing a forward saves L layers + the final norm: the planner's per-layer count."""
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    config = config_cls(**TINY, use_cache=False, attn_implementation=attn)
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32).train()
    tokens = 256
    measured = _saved_bytes(model, torch.randint(0, TINY["vocab_size"], (1, tokens)))
    shape = ModelShape.from_config(config.to_dict())
    run = RunConfig(seq_len=tokens, dtype=dtype, attn=attn)
    layer = layer_bytes(shape, run, tokens, on_cpu=True)
    # Not planner terms: the embedding's int64 indices and RoPE's cos/sin (shared by every layer).
    extra = 8 * tokens + 2 * tokens * shape.head_dim * run.act_bytes
    predicted = shape.layers * layer.saved + tokens * norm_bytes(shape.hidden, run.act_bytes, False) + extra
    assert predicted == measured


def test_eager_scores_grow_quadratically_flash_linearly():
    run = RunConfig(seq_len=4096, attn="eager")
    small, big = (layer_bytes(QWEN, run.with_seq_len(s), s, False).saved for s in (4096, 8192))
    flash_small, flash_big = (layer_bytes(QWEN, RunConfig(seq_len=s), s, False).saved for s in (4096, 8192))
    assert flash_big == pytest.approx(2 * flash_small)
    assert big > 3.5 * small


# ---- model states --------------------------------------------------------------------------------


def test_model_states_bytes_per_parameter():
    n = LLAMA.num_params()
    ddp = model_state_bytes(LLAMA, RunConfig(seq_len=1, dtype="fp32"))
    assert (ddp["parameters"], ddp["gradients"], ddp["optimizer_states"]) == (4 * n, 4 * n, 8 * n)
    assert ddp["gradients_persistent"] == 0  # param.grad only from backward on (set_to_none)
    ddp2 = model_state_bytes(LLAMA, RunConfig(seq_len=1, world=2, dtype="fp32"))
    assert ddp2["gradients"] == 8 * n and ddp2["gradients_persistent"] == 4 * n  # + DDP's buckets
    zero = {e: model_state_bytes(LLAMA, RunConfig(seq_len=1, world=8, engine=e)) for e in ("zero1", "zero2", "zero3")}
    assert zero["zero1"]["parameters"] == 2 * n and zero["zero1"]["optimizer_states"] == 12 * n / 8
    assert zero["zero2"]["gradients"] == 2 * n / 8 and zero["zero2"]["parameters"] == 2 * n
    assert zero["zero3"]["parameters"] == 2 * n / 8 == zero["zero3"]["gradients_persistent"]


def test_ddp_bf16_is_mixed_precision_with_fp32_masters():
    # The recipes load fp32 weights and autocast to bf16 (pure bf16 AdamW rounds lr-1e-5 updates away).
    n = LLAMA.num_params()
    for world, buckets in ((1, 0), (4, 4 * n)):
        bf16 = model_state_bytes(LLAMA, RunConfig(seq_len=1, world=world, sp=world))
        assert bf16 == model_state_bytes(LLAMA, RunConfig(seq_len=1, world=world, sp=world, dtype="fp32"))
        assert (bf16["parameters"], bf16["optimizer_states"]) == (4 * n, 8 * n)
        assert bf16["gradients"] == 4 * n + buckets and bf16["gradients_persistent"] == buckets
    plan = estimate(QWEN, RunConfig(seq_len=1024, world=4, sp=4), H100)
    # AdamW's fp32 m, v plus foreach's fp32 sqrt(v) temporary at the step.
    assert plan.peak_phase == "optimizer"
    assert plan.breakdown["optimizer_states"] == pytest.approx(12 * QWEN.num_params() / GIB, abs=1e-3)


def test_gpu_recipes_load_fp32_weights_and_autocast_to_bf16():
    recipes = {p.name: yaml.safe_load(p.read_text()) for p in (ROOT / "recipes").glob("*.yaml")}
    pretrained = {name: r for name, r in recipes.items() if r.get("model_name_or_path")}
    assert pretrained
    for name, recipe in pretrained.items():
        assert recipe.get("model_dtype") == "float32" and recipe.get("bf16") is True, name


def test_offload_moves_states_off_the_device():
    run = RunConfig(seq_len=1, world=8, engine="zero3", offload_optimizer=True)
    states = model_state_bytes(LLAMA, run)
    assert states["optimizer_states"] == 0 and states["gradients"] == 0
    assert states["parameters"] == 2 * LLAMA.num_params() / 8
    both = model_state_bytes(LLAMA, RunConfig(seq_len=1, engine="zero3", offload_optimizer=True, offload_params=True))
    assert both["parameters"] == 0
    fsdp = model_state_bytes(LLAMA, RunConfig(seq_len=1, world=4, engine="fsdp2", offload_params=True))
    assert fsdp == {"parameters": 0, "gradients": 0, "gradients_persistent": 0, "optimizer_states": 0}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world": 6, "sp": 4}, "multiple of --sp"),
        ({"engine": "ddp", "offload_optimizer": True}, "DeepSpeed engine"),
        ({"engine": "fsdp2", "offload_optimizer": True}, "fsdp2 --offload-params"),
        ({"engine": "zero2", "offload_params": True}, "zero3 or"),
        ({"engine": "zero3", "offload_params": True}, "add --offload-optimizer"),
        ({"tiled_mlp": 0}, "tile count"),
        ({"engine": "megatron"}, "--engine"),
        ({"seq_len": 0}, "seq_len"),
    ],
)
def test_invalid_runs_name_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**{"seq_len": 1024, **kwargs})


def test_sp_must_divide_query_heads():
    with pytest.raises(ValueError, match=r"valid --sp: \[1, 2, 4, 8, 16, 32\]"):
        estimate(LLAMA, RunConfig(seq_len=1024, world=3, sp=3), H100)


# ---- the step's terms ----------------------------------------------------------------------------


def test_breakdown_sums_to_peak_and_names_every_term():
    plan = estimate(QWEN, RunConfig(seq_len=65536, world=4, sp=4, engine="zero3", gradient_checkpointing=True), H100)
    assert tuple(plan.breakdown) == TERMS
    assert sum(plan.breakdown.values()) == pytest.approx(plan.peak_gib, abs=0.01)
    assert plan.dominant == max(plan.breakdown, key=plan.breakdown.get)
    assert plan.peak_gib == pytest.approx(max(plan.phases.values()), abs=0.01)
    assert plan.fits == (plan.peak_gib <= plan.capacity_gib)


def test_checkpoints_and_untiled_logits_closed_form():
    """Checkpointing keeps L hidden states of T x h; the plain loss peaks at 12 fp32 bytes per logit."""
    s, sp = 131072, 8
    run = RunConfig(seq_len=s, world=sp, sp=sp, engine="zero3", gradient_checkpointing=True)
    plan = estimate(LLAMA, run, H100)
    tokens = s // sp
    assert plan.phases["loss"] > plan.phases["backward"]
    checkpoints = LLAMA.layers * tokens * LLAMA.hidden * 2
    final_norm = tokens * ((4 + 2 * 2) * LLAMA.hidden + 4)
    assert plan.breakdown["saved_activations"] == pytest.approx((checkpoints + final_norm) / GIB, abs=1e-3)
    assert plan.breakdown["logits_loss"] == pytest.approx(12 * tokens * LLAMA.vocab / GIB, abs=1e-3)


def test_offloaded_activations_keep_two_layers_on_gpu_but_nothing_moves_on_cpu():
    run = RunConfig(seq_len=262144, world=8, sp=8, engine="zero3", gradient_checkpointing=True, tiled_loss=True)
    on = RunConfig(**{**run.__dict__, "offload_activations": True})
    tokens, per_layer = 262144 // 8, 262144 // 8 * LLAMA.hidden * 2
    gpu_off, gpu_on = estimate(LLAMA, run, H100), estimate(LLAMA, on, H100)
    saved_off, saved_on = (p.breakdown["saved_activations"] * GIB for p in (gpu_off, gpu_on))
    assert saved_off - saved_on == pytest.approx((LLAMA.layers - 2) * per_layer, rel=1e-4)
    assert any("on the host" in note for note in gpu_on.notes)
    cpu_off, cpu_on = estimate(LLAMA, run, CPU), estimate(LLAMA, on, CPU)
    assert cpu_on.peak_gib == cpu_off.peak_gib and any("same memory" in n for n in cpu_on.notes)
    assert tokens == gpu_on.tokens_per_rank


def test_tiled_loss_and_tiled_mlp_shrink_their_terms():
    base = RunConfig(seq_len=1_048_576, world=8, sp=8, engine="zero3", gradient_checkpointing=True)
    tokens = 1_048_576 // 8
    untiled = loss_bytes(LLAMA, base, tokens, fused=False)
    fused = loss_bytes(LLAMA, RunConfig(**{**base.__dict__, "tiled_loss": True}), tokens, fused=True)
    assert untiled == 12 * tokens * LLAMA.vocab and fused < untiled / 40
    chunked = loss_bytes(LLAMA, RunConfig(**{**base.__dict__, "tiled_loss": True}), tokens, fused=False)
    # hf_longctx's tiles (2**24 logits) keep less than Liger's chunk here; both far below the full logits.
    assert chunked < untiled / 30 and fused < untiled / 30
    tile = 2**24 // LLAMA.vocab
    assert chunked == 6 * tile * LLAMA.vocab + 2 * tokens * LLAMA.hidden + 4 * LLAMA.vocab * LLAMA.hidden
    plain = layer_bytes(LLAMA, base, tokens, on_cpu=False)
    tiled = layer_bytes(LLAMA, RunConfig(**{**base.__dict__, "tiled_mlp": True}), tokens, on_cpu=False)
    mlp_saved = 2 * tokens * LLAMA.intermediate * 4  # gate, act, up, product in bf16
    assert plain.saved - tiled.saved == pytest.approx(mlp_saved)
    assert tiled.backward < plain.backward
    # One tile is the MLP as is (the implementation does not wrap it), as is True below 4096 tokens.
    one_tile = layer_bytes(LLAMA, RunConfig(**{**base.__dict__, "tiled_mlp": 1}), tokens, on_cpu=False)
    assert one_tile == plain
    short = RunConfig(**{**base.__dict__, "seq_len": 8 * 4096, "tiled_mlp": True})
    assert layer_bytes(LLAMA, short, 4096, on_cpu=False) == layer_bytes(
        LLAMA, RunConfig(**{**short.__dict__, "tiled_mlp": False}), 4096, on_cpu=False
    )


def test_offload_activations_checkpoints_every_layer_itself():
    off = RunConfig(seq_len=65536, world=8, sp=8, engine="zero3")
    with_gc = RunConfig(**{**off.__dict__, "gradient_checkpointing": True, "offload_activations": True})
    alone = RunConfig(**{**off.__dict__, "offload_activations": True})
    gpu = DEVICES["h100"]
    assert estimate(LLAMA, alone, gpu).peak_gib == estimate(LLAMA, with_gc, gpu).peak_gib
    assert estimate(LLAMA, alone, gpu).peak_gib < estimate(LLAMA, off, gpu).peak_gib


def test_ulysses_kv_replication_and_buffers():
    """At SP > kv heads every rank receives one kv head: q, k, v of the full sequence for H/sp heads."""
    tokens = 4096
    for sp in (4, 8, 16, 32):
        run = RunConfig(seq_len=tokens * sp, world=sp, sp=sp, gradient_checkpointing=True)
        layer = layer_bytes(LLAMA, run, tokens, on_cpu=False)
        kv_per_rank = max(LLAMA.kv_heads // sp, 1)
        full_seq = tokens * sp
        qkv = 2 * full_seq * LLAMA.head_dim * (LLAMA.heads // sp + 2 * kv_per_rank)
        assert layer.all_to_all == qkv


@settings(max_examples=40, deadline=None)
@given(
    seq=st.integers(1, 2**22),
    sp=st.sampled_from([1, 2, 4, 8]),
    engine=st.sampled_from(["ddp", "zero1", "zero2", "zero3", "fsdp2"]),
    gc=st.booleans(),
    tiled=st.booleans(),
    attn=st.sampled_from(["flash", "sdpa", "eager"]),
)
def test_peak_is_monotonic_in_sequence_length(seq, sp, engine, gc, tiled, attn):
    # A fixed tile count: tiled_mlp=True starts tiling only above max(hidden, 4096) tokens per rank, where the
    # peak (measured and planned) steps down once (see `max_seq_len`).
    flags = {"gradient_checkpointing": gc, "tiled_loss": tiled, "tiled_mlp": 8 if tiled else False}
    run = RunConfig(seq_len=seq, world=sp, sp=sp, engine=engine, attn=attn, **flags)
    a, b = (estimate(QWEN, run.with_seq_len(s), H100).peak_gib for s in (seq, seq + sp))
    assert b >= a


def test_sp_divides_per_rank_activations():
    """Per-rank activations at SP=k, S=kx equal SP=1, S=x up to the all-to-all copies."""
    one = estimate(QWEN, RunConfig(seq_len=32768, gradient_checkpointing=True), H100)
    four = estimate(QWEN, RunConfig(seq_len=4 * 32768, world=4, sp=4, gradient_checkpointing=True), H100)
    assert four.breakdown["logits_loss"] == one.breakdown["logits_loss"]
    assert four.breakdown["saved_activations"] == one.breakdown["saved_activations"]


# ---- longest sequence ----------------------------------------------------------------------------


@pytest.mark.parametrize("sp", [1, 8])
def test_max_seq_len_is_the_fit_boundary(sp):
    run = RunConfig(seq_len=1, world=8, sp=sp, engine="zero3", offload_optimizer=True, gradient_checkpointing=True)
    longest = max_seq_len(LLAMA, run, H100)
    assert longest % sp == 0 and longest > 0
    assert estimate(LLAMA, run.with_seq_len(longest), H100).fits
    assert not estimate(LLAMA, run.with_seq_len(longest + sp), H100).fits


def test_max_seq_len_is_zero_when_nothing_fits():
    assert max_seq_len(LLAMA, RunConfig(seq_len=1), H100.with_capacity(10.0)) == 0


def test_validation_harness_maps_points_to_runs():
    """`benchmarks/plan_validate.py`: the measured configuration is the one the planner is asked about."""
    from benchmarks.plan_validate import run_config

    point = {"name": "x", "seq_len": 8192, "sp": 2, "gradient_checkpointing": True, "flags": {"tiled_mlp": 4}}
    run = run_config(point)
    assert (run.seq_len, run.world, run.sp, run.engine, run.dtype, run.attn) == (8192, 2, 2, "ddp", "fp32", "sdpa")
    assert run.gradient_checkpointing and run.tiled_mlp == 4 and not run.tiled_loss
    assert run_config({"name": "y", "seq_len": 64, "sp": 1, "world": 2}).world == 2


@pytest.mark.parametrize("seq", [37, 2048, 5000, 65536, 100003])
def test_eager_scores_count_the_blocks_the_kernel_runs(seq):
    from hf_longctx.attention.blocks import plan_segment
    from hf_longctx.planner.terms import eager_scores

    blocks = plan_segment(seq, None, always_mask=True, max_elements=2**22)
    assert eager_scores(seq, sp=2) == sum(b.scores for b in blocks)
    assert eager_scores(seq, sp=1) == seq * seq


def test_offloaded_activations_need_host_ram_per_node():
    flags = {"gradient_checkpointing": True, "offload_activations": True}
    run = RunConfig(seq_len=131072, world=8, sp=4, engine="zero3", **flags)
    per_rank = QWEN.layers * (131072 // 4) * QWEN.hidden * 2  # every layer's bf16 input, pinned
    plan = estimate(QWEN, run, H100)
    assert plan.host_gib == round(8 * per_rank / GIB, 3) and plan.fits and plan.host_capacity_gib is None
    two = estimate(QWEN, RunConfig(**{**run.__dict__, "ranks_per_node": 2}), H100)
    assert two.host_gib == round(2 * per_rank / GIB, 3)
    limited = RunConfig(**{**run.__dict__, "host_memory_gib": 8 * per_rank / GIB - 1})
    refused = estimate(QWEN, limited, H100)
    assert not refused.fits and refused.peak_gib == plan.peak_gib and "--sp" in refused.notes[-1]
    longest = max_seq_len(QWEN, limited, H100)
    assert 0 < longest < 131072 and estimate(QWEN, limited.with_seq_len(longest), H100).fits
    assert estimate(QWEN, RunConfig(seq_len=4096, gradient_checkpointing=True), H100).host_gib == 0
    assert estimate(QWEN, RunConfig(seq_len=4096, offload_activations=True), CPU).host_gib == 0  # host is the device


@pytest.mark.parametrize("backend", ["ring", "hybrid", "auto"])
def test_unmodelled_sp_backends_are_refused_by_name(backend):
    with pytest.raises(ValueError, match=f"--sp-backend {backend} is not modelled"):
        RunConfig(seq_len=1024, world=4, sp=4, sp_backend=backend)
    assert RunConfig(seq_len=1024, sp_backend="ulysses").sp_backend == "ulysses"


def test_router_loss_keeps_every_layers_router_logits():
    """`--router-loss` adds, per layer, the [tokens, experts] router logits hf_longctx.sequence keeps to the
    backward; under checkpointing they are recomputed with the layer; without experts it changes nothing."""
    from hf_longctx.planner import ModelShape, RunConfig, estimate
    from hf_longctx.planner.devices import DEVICES

    moe = ModelShape(name="moe", vocab=1024, hidden=128, intermediate=256, layers=8, heads=4, kv_heads=2,
                     head_dim=32, experts=64, experts_per_token=2, expert_intermediate=64)  # fmt: skip
    device = DEVICES["h100"]
    for checkpointing in (False, True):
        base = RunConfig(seq_len=65536, gradient_checkpointing=checkpointing)
        on = RunConfig(seq_len=65536, gradient_checkpointing=checkpointing, router_loss=True)
        with_loss, without = estimate(moe, on, device), estimate(moe, base, device)
        assert with_loss.peak_phase == without.peak_phase
        added = with_loss.breakdown["saved_activations"] - without.breakdown["saved_activations"]
        kept = 0 if checkpointing else 8 * 65536 * 64 * base.act_bytes
        assert added == pytest.approx(kept / 2**30, abs=2e-3)  # GiB, rounded
    dense = ModelShape(name="dense", vocab=1024, hidden=128, intermediate=256, layers=8, heads=4, kv_heads=2,
                       head_dim=32)  # fmt: skip
    assert (
        estimate(dense, RunConfig(seq_len=4096, router_loss=True), device).peak_gib
        == estimate(dense, RunConfig(seq_len=4096), device).peak_gib
    )

"""The token-mixer check knows Qwen3-Next's Gated DeltaNet and refuses other mixers by layer name (no process group)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_longctx import SequenceParallelGroups, enable_sequence_parallel, shard_batch
from hf_longctx.attention.registry import check_model
from tests.dist._linear_jobs import make_batch, tiny_qwen3_next

SINGLE = SequenceParallelGroups.single()
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


@pytest.mark.parametrize("sp_size", [1, 2, 4])
def test_qwen3_next_passes_the_check_when_its_heads_divide(sp_size):
    for backend in ("ulysses", "auto"):
        assert check_model(tiny_qwen3_next(), sp_size, backend).name in ("ulysses", "ring", "hybrid")


def test_indivisible_linear_heads_are_refused_with_the_sizes_that_work():
    model = tiny_qwen3_next(key_heads=2, value_heads=6)
    for backend in ("ulysses", "auto", "ring"):
        with pytest.raises(ValueError, match=r"linear_num_key_heads=2 .*sp_size=4.*\[1, 2\]") as err:
            check_model(model, 4, backend)
        assert "layers.0.linear_attn" in str(err.value)
    with pytest.raises(ValueError, match=r"linear_num_value_heads=6.*sp_size=3.*\[1, 2\]"):
        check_model(tiny_qwen3_next(key_heads=2, value_heads=6), 3, "ring")


@pytest.mark.parametrize(
    ("model_type", "extra", "match"),
    [
        (
            "bamba",
            {"num_hidden_layers": 2, "attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16},
            r"layers.0.mamba \(layer type 'linear_attention'\) is BambaMixer, a Mamba2 mixer.*gated RMSNorm .*"
            "normalises over all heads",
        ),
        (
            "falcon_h1",
            {"num_hidden_layers": 2, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128},
            r"layers.0.mamba \(layer type 'hybrid'\) is FalconH1Mixer",
        ),
    ],
)
def test_mamba_mixers_are_refused_by_layer_name(model_type, extra, match):
    config = AutoConfig.for_model(model_type, **TINY, **extra)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    for sp_size in (1, 2):
        with pytest.raises(ValueError, match=match) as err:
            check_model(model, sp_size)
        assert "sp_size=1" in str(err.value)
    with pytest.raises(ValueError, match=match):
        enable_sequence_parallel(model, SINGLE)
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_linear_layer_that_bypasses_the_adapter_fails_the_forward():
    # The forward-time count: a supported linear layer that did not run head-parallel is caught.
    model = tiny_qwen3_next()
    batch = shard_batch(make_batch("packed3"), SINGLE)
    batch.pop("shift_labels")
    with enable_sequence_parallel(model, SINGLE) as handle:
        assert handle.num_linear == 2
        layer = model.model.layers[2].linear_attn
        layer.forward = lambda hidden_states, **kwargs: torch.zeros_like(hidden_states)
        with pytest.raises(ValueError, match="1 of 2 linear-attention layers ran head-parallel"):
            model(**batch)


def test_enable_and_remove_leave_the_layers_as_they_were():
    model = tiny_qwen3_next()
    layer = model.model.layers[0].linear_attn
    with enable_sequence_parallel(model, SINGLE):
        assert "forward" in vars(layer)
    assert "forward" not in vars(layer)
    assert type(layer).forward is layer.forward.__func__


@pytest.mark.parametrize(
    ("model_type", "extra", "sp", "said"),
    [
        ("qwen3_next", {"linear_num_key_heads": 2, "linear_num_value_heads": 4}, "4", "sp_size values that work"),
        ("bamba", {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16}, "2", "is BambaMixer"),
    ],
)
def test_hf_longctx_check_refuses_before_launching(tmp_path, capsys, monkeypatch, model_type, extra, sp, said):
    import hf_longctx.check.worker
    from hf_longctx.cli import main

    def no_launch(*args, **kwargs):
        raise AssertionError("nothing may be launched for a refused model")

    monkeypatch.setattr(hf_longctx.check.worker.subprocess, "Popen", no_launch)
    AutoConfig.for_model(model_type, **TINY, num_hidden_layers=2, **extra).save_pretrained(tmp_path)
    code = main(["check", "--model", str(tmp_path), "--sp", sp])
    out = capsys.readouterr().out
    assert code == 2 and said in out, out

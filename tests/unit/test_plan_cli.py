"""`hf-longctx plan` on the command line: output, JSON contract, exit codes, errors."""

from __future__ import annotations

import json

import pytest

from hf_longctx.cli import main
from hf_longctx.planner import DEVICES, RunConfig, estimate, max_seq_len
from hf_longctx.planner.model_shape import load_model_shape

QWEN_128K = ["plan", "--model", "qwen3-4b", "--seq-len", "131072", "--world", "4", "--sp", "4"]


def _json(capsys, argv):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_json_has_the_contract_fields_and_matches_the_library(capsys):
    argv = [*QWEN_128K, "--engine", "zero3", "--gradient-checkpointing", "--max-seq"]
    code, out = _json(capsys, argv)
    run = RunConfig(seq_len=131072, world=4, sp=4, engine="zero3", gradient_checkpointing=True)
    plan = estimate(load_model_shape("qwen3-4b"), run, DEVICES["h100"])
    assert {"peak_gib", "fits", "capacity_gib", "breakdown", "max_seq", "dominant"} <= set(out)
    assert out["peak_gib"] == plan.peak_gib and out["fits"] == plan.fits and out["breakdown"] == plan.breakdown
    assert out["max_seq"] == max_seq_len(load_model_shape("qwen3-4b"), run, DEVICES["h100"])
    assert code == (0 if plan.fits else 1)
    assert "max_seq" not in _json(capsys, QWEN_128K)[1]


def test_text_output_names_terms_dominant_and_verdict(capsys):
    code = main([*QWEN_128K, "--gradient-checkpointing", "--max-seq"])
    text = capsys.readouterr().out
    assert code == 1
    for term in ("parameters", "optimizer states", "zero3 gathers", "logits loss", "all to all buffers"):
        assert term in text
    assert "dominant term: logits loss" in text and "does NOT fit" in text
    assert "longest sequence that fits:" in text


def test_flags_reach_the_run(capsys):
    flags = ["--gradient-checkpointing", "--tiled-loss", "--tiled-mlp", "8", "--offload-activations"]
    argv = [*QWEN_128K, *flags, "--gpu", "h200"]  # DDP's fp32 states (75 GiB) need an H200
    code, out = _json(capsys, argv)
    assert out["run"]["tiled_mlp"] == 8 and out["run"]["tiled_loss"] and out["run"]["offload_activations"]
    assert code == 0 and out["breakdown"]["logits_loss"] < 1.0
    assert _json(capsys, [*QWEN_128K, "--tiled-mlp"])[1]["run"]["tiled_mlp"] is True


def test_gpu_memory_and_cpu_profiles(capsys):
    _, small = _json(capsys, [*QWEN_128K, "--gpu-memory", "24"])
    assert small["capacity_gib"] == 24 and not small["fits"]
    _, cpu = _json(capsys, [*QWEN_128K, "--gpu", "cpu", "--dtype", "fp32", "--attn", "sdpa"])
    assert cpu["device"] == "cpu" and cpu["capacity_gib"] > 0


def test_config_path_model(capsys, tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out = _json(capsys, ["plan", "--model", str(tmp_path), "--seq-len", "4096", "--sp", "2"])
    assert code == 0 and out["tokens_per_rank"] == 2048 and out["model"] == str(tmp_path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sp", "3", "--world", "3"], "valid --sp"),
        (["--engine", "ddp", "--offload-optimizer"], "DeepSpeed engine"),
        (["--gpu-memory", "0"], "--gpu-memory"),
    ],
)
def test_invalid_input_exits_2_naming_the_fix(capsys, extra, message):
    argv = ["plan", "--model", "qwen3-4b", "--seq-len", "8192", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_model_exits_2(capsys):
    assert main(["plan", "--model", "nope", "--seq-len", "8"]) == 2
    assert "qwen3-4b" in capsys.readouterr().err


def test_host_memory_refuses_offload_that_does_not_fit(capsys):
    argv = [*QWEN_128K, "--engine", "zero3", "--gradient-checkpointing", "--offload-activations"]
    assert main([*argv, "--host-memory", "1000"]) == 3  # fits the device with 2% headroom: tight
    text = capsys.readouterr().out
    assert "78.01  of 79.65: tight (2% headroom)" in text
    assert "host RAM per node (offloaded activations and states, 4 ranks): 22.50 GiB, limit 1000 GiB" in text
    assert "SP backend ulysses (modelled: ulysses; not modelled: ring, hybrid, auto)" in text
    assert main([*argv, "--host-memory", "16"]) == 1
    captured = capsys.readouterr()
    assert "NOT the host RAM" in captured.out and "more SP (--sp) or no --offload-activations" in captured.err
    _, out = _json(capsys, [*argv, "--host-memory", "16", "--ranks-per-node", "2"])
    assert out["fits"] and out["host_gib"] == 11.25 and out["host_capacity_gib"] == 16


def test_unmodelled_backend_exits_2(capsys):
    assert main([*QWEN_128K, "--sp-backend", "ring"]) == 2
    assert "--sp-backend ring is not modelled" in capsys.readouterr().err


def test_activation_checkpointing_is_the_flag_and_the_setting_with_the_old_flag_kept(capsys, tmp_path):
    """transformers 5.25 deprecates TrainingArguments' `gradient_checkpointing` (FutureWarning) for
    `activation_checkpointing`: the plan prints the new name, takes both flags, and the printed setting is one a recipe
    YAML and SFTConfig accept without the warning."""
    import warnings

    from trl import SFTConfig, TrlParser

    from hf_longctx.planner.settings import settings_for

    old = _json(capsys, [*QWEN_128K, "--gradient-checkpointing"])[1]["run"]
    assert old == _json(capsys, [*QWEN_128K, "--activation-checkpointing"])[1]["run"] and old["gradient_checkpointing"]
    settings = settings_for("qwen3-4b", RunConfig(seq_len=131072, world=4, sp=4, gradient_checkpointing=True))
    assert settings.training_arguments["activation_checkpointing"] is True
    assert "gradient_checkpointing" not in settings.training_arguments
    assert "--activation-checkpointing" in settings.plan_command.split()
    main([*QWEN_128K, "--activation-checkpointing"])
    text = capsys.readouterr().out
    assert "activation checkpointing" in text and "activation_checkpointing=True" in text
    recipe = tmp_path / "recipe.yaml"
    fields = {**settings.training_arguments, "bf16": False}  # bf16 needs a GPU
    recipe.write_text("".join(f"{k}: {str(v).lower()}\n" for k, v in fields.items()) + "use_cpu: true\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        (args,) = TrlParser((SFTConfig,)).parse_args_and_config(
            ["--config", str(recipe), "--output_dir", str(tmp_path)]
        )
    assert args.activation_checkpointing is True

"""`hf-longctx plan` leads somewhere: a plan that does not fit with the planner's error as headroom ends in the
cheapest configuration that does, as settings that exist (TrainingArguments / SFTConfig and ParallelismConfig
fields, a shipped accelerate YAML with `accelerate launch` flags that accelerate accepts, configuring the engine
planned). Issue 36, item 4. Torch-free except where the real setting classes are checked."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shlex
import sys

import pytest

from hf_longctx.cli import main
from hf_longctx.cli.main import build_parser
from hf_longctx.cli.plan import run_config
from hf_longctx.planner import DEVICES, LAUNCH_CONFIGS, PLAN_ERROR, RunConfig, estimate, load_model_shape
from hf_longctx.planner.model_shape import ModelShape
from hf_longctx.planner.search import TILED_LAYER_TYPES, candidates, changes, cost, search
from hf_longctx.planner.settings import settings_for
from tests._dist import REPO_ROOT

H100 = DEVICES["h100"]
ACCEPTANCE = {  # issue 36: default flags on 8 x H100
    "llama3.1-8b at 131K": ["plan", "--model", "llama3.1-8b", "--seq-len", "131072", "--world", "8"],
    "qwen3-4b at 1M": ["plan", "--model", "qwen3-4b", "--seq-len", "1048576", "--world", "8"],
}
MOE = ModelShape(name="moe", hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, intermediate=1024, vocab=1000,
                 experts=8, experts_per_token=2, expert_intermediate=256, model_type="mixtral")  # fmt: skip


def _json(capsys, argv: list[str]) -> tuple[int, dict]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", ACCEPTANCE)
def test_default_flags_on_8_h100_end_in_a_configuration_that_fits(capsys, case):
    code, out = _json(capsys, ACCEPTANCE[case])
    assert code == 1 and out["verdict"] == "does NOT fit"
    found = out["search"]["fits"]
    assert found is not None and found["headroom"] >= PLAN_ERROR
    # The printed plan command plans that configuration, and it fits.
    again_code, again = _json(capsys, shlex.split(found["plan_command"])[1:])
    assert again_code == 0 and again["verdict"] == "fits" and again["peak_gib"] == found["peak_gib"]
    assert main(ACCEPTANCE[case]) == 1
    text = capsys.readouterr().out
    assert "cheapest configuration that fits" in text and found["launch_command"] in text
    assert "parallelism_config=hf_longctx.ParallelismConfig(sp_size=" in text


def test_verdict_fits_tight_and_does_not_fit():
    model = load_model_shape("qwen3-4b")
    run = RunConfig(seq_len=131072, world=4, sp=4, engine="zero3", gradient_checkpointing=True)
    plan = estimate(model, run, H100)
    assert plan.verdict() == "does NOT fit"
    device = H100.with_capacity(plan.peak_gib / (1 - PLAN_ERROR / 2))
    assert estimate(model, run, device).verdict() == "tight"
    device = H100.with_capacity(plan.peak_gib / (1 - PLAN_ERROR) + 0.01)
    assert estimate(model, run, device).verdict() == "fits"


def test_the_search_returns_the_cheapest_fit():
    """Brute force: no candidate cheaper than the answer fits, and none as cheap fits with fewer changes."""
    model = load_model_shape("llama3.1-8b")
    run = RunConfig(seq_len=262144, world=8)
    found = search(model, run, H100)
    best = found.best
    assert best is not None and best.plan.fits_within(PLAN_ERROR) and found.planned < found.candidates
    for config in candidates(model, run):
        if (cost(config), changes(config, run)) < (best.cost, best.changes):
            assert not estimate(model, config, H100).fits_within(PLAN_ERROR), config


def test_the_search_respects_host_memory():
    model = load_model_shape("llama3.1-8b")
    free = search(model, RunConfig(seq_len=4_000_000, world=8), H100).best
    assert free is not None and free.run.offload_activations and free.plan.host_gib > 500
    enough = search(model, RunConfig(seq_len=4_000_000, world=8, host_memory_gib=1000), H100).best
    assert enough is not None and enough.plan.host_gib <= 1000 and enough.plan.peak_gib == free.plan.peak_gib
    # 256 GiB of host RAM per node: only offloading lowers the peak enough, and its host RAM does not fit.
    short = search(model, RunConfig(seq_len=4_000_000, world=8, host_memory_gib=256), H100)
    assert short.best is None and short.lowest.plan.verdict() == "fits the device, NOT the host RAM"


def test_nothing_fits_says_so_with_the_lowest_peak(capsys):
    argv = ["plan", "--model", "llama3.1-8b", "--seq-len", "131072", "--world", "2", "--gpu-memory", "8"]
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert "no configuration fits with 15% headroom" in text and "lowest peak:" in text


def test_no_search_on_the_cpu_profile(capsys):
    """The CPU profile checks the model against CPU runs; the search's settings launch GPU jobs."""
    code, out = _json(capsys, [*ACCEPTANCE["qwen3-4b at 1M"], "--gpu-memory", "8"])
    assert code == 1 and out["search"]["fits"] is None
    code, out = _json(capsys, [*ACCEPTANCE["qwen3-4b at 1M"], "--gpu", "cpu", "--dtype", "fp32", "--attn", "sdpa"])
    assert out["verdict"] != "fits" and "search" not in out


def test_liger_is_never_suggested_and_maps_to_no_setting(capsys):
    model = load_model_shape("llama3.1-8b")
    run = RunConfig(seq_len=1_000_000, world=8, sp=8, liger_kernels=True)
    assert not any(c.liger_kernels for c in candidates(model, run))
    with pytest.raises(ValueError, match="no hf_longctx setting"):
        settings_for("llama3.1-8b", run)
    assert main(["plan", "--model", "llama3.1-8b", "--seq-len", "1000000", "--world", "8", "--liger-kernels"]) == 1
    assert "planned without --liger-kernels" in capsys.readouterr().out


def test_only_tiled_features_hf_longctx_applies_are_searched():
    from hf_longctx.memory.layer_match import _REFERENCE_MODULES

    assert set(TILED_LAYER_TYPES) == set(_REFERENCE_MODULES)
    moe = list(candidates(MOE, RunConfig(seq_len=8192, world=2)))
    assert moe and not any(c.tiled_mlp or c.tiled_layer for c in moe)  # routed experts untiled; not a Llama layer
    assert any(c.tiled_layer for c in candidates(load_model_shape("qwen3-4b"), RunConfig(seq_len=8192, world=2)))


def _every_suggestion() -> list[tuple[str, RunConfig]]:
    """Every configuration the search can print, over the settings that change what is printed: model (router
    loss, head chunks), world (1 GPU, 1 node, 2 nodes), dtype."""
    worlds, dtypes = (1, 4, 8, 16), ("bf16", "fp32")
    runs = [("llama3.1-8b", RunConfig(seq_len=65536, world=w, dtype=d)) for w in worlds for d in dtypes]
    runs.append(("moe", RunConfig(seq_len=8192, world=8, router_loss=True)))
    models = {"moe": MOE}
    return [(name, c) for name, run in runs for c in candidates(models.get(name) or load_model_shape(name), run)]


def test_every_printable_suggestion_is_a_real_setting():
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from transformers import MixtralConfig, TrainingArguments
    from trl import SFTConfig

    from hf_longctx import ParallelismConfig

    trainer = {f.name for f in dataclasses.fields(TrainingArguments)}
    arguments = trainer & {f.name for f in dataclasses.fields(SFTConfig)}
    parser, plan_parser, seen, configs, slurm = launch_command_parser(), build_parser(), set(), set(), set()
    for model, run in _every_suggestion():
        settings = settings_for(model, run)
        assert set(settings.training_arguments) <= arguments
        assert set(settings.model_config) <= set(MixtralConfig().to_dict())
        if (config := json.dumps(settings.parallelism_config, sort_keys=True)) not in configs:
            configs.add(config)
            ParallelismConfig(**settings.parallelism_config)
        # What the launch checks below read: parsing each distinct one once (accelerate re-reads the YAML each time).
        key = (settings.launch_command, settings.launch_config, run.engine, run.world, run.node_ranks,
               run.offload_optimizer, run.offload_params, run.dtype)  # fmt: skip
        if key not in seen:
            seen.add(key)
            argv = shlex.split(settings.launch_command.replace("$NODE_RANK", "0").replace("$MAIN_NODE_IP", "10.0.0.1"))
            assert argv[:4] == ["accelerate", "launch", "--config_file", settings.launch_config]
            assert (REPO_ROOT / settings.launch_config).is_file()
            launch, _, _ = _validate_launch_command(parser.parse_args(argv[2:]))
            assert _launched(launch) == (run.engine, run.world, -(-run.world // run.node_ranks)), argv
            assert _offloads(launch) == (run.offload_optimizer, run.offload_params), argv
            assert launch.mixed_precision == ("bf16" if run.dtype == "bf16" else "no"), argv
        args = plan_parser.parse_args(shlex.split(settings.plan_command)[1:])
        assert run_config(args) == run, settings.plan_command
        if run.world > run.node_ranks:
            _check_slurm(settings, run, parser, slurm)


def _check_slurm(settings, run: RunConfig, parser, seen: set) -> None:
    """The Slurm line runs the planned run: configs/slurm_2nodes.sbatch's `accelerate launch` (with the allocation
    the line asks for) resolves to its engine, processes, nodes, offloads and precision, and recipes/sft.py's parser
    takes its recipe arguments to the planned settings. Only head chunks and the router loss have no sft.py argument."""
    from accelerate.commands.launch import _validate_launch_command

    if settings.slurm_command is None:
        assert run.ulysses_head_chunks > 1 or run.router_loss, run
        return
    words = shlex.split(settings.slurm_command)
    env = dict(w.split("=", 1) for w in words[: words.index("sbatch")])
    assert set(env) <= {"CONFIG", "RECIPE", "LAUNCH_FLAGS"} and env["CONFIG"] == settings.launch_config, env
    at = words.index("configs/slurm_2nodes.sbatch")
    options = dict(w[2:].split("=") for w in words[words.index("sbatch") + 1 : at])
    nodes, per_node = int(options.get("nodes", 2)), int(options.get("gpus-per-node", 8))
    argv = ["--config_file", env["CONFIG"], *shlex.split(env.get("LAUNCH_FLAGS", ""))]
    argv += ["--num_machines", str(nodes), "--num_processes", str(nodes * per_node), "--machine_rank", "0"]
    key = (*argv, run.engine, run.world, run.node_ranks, run.offload_optimizer, run.offload_params, run.dtype)
    if key not in seen:  # each distinct launch once (accelerate re-reads the YAML each time)
        seen.add(key)
        launch, _, _ = _validate_launch_command(parser.parse_args([*argv, "--main_process_ip", "10.0.0.1", "t.py"]))
        assert _launched(launch) == (run.engine, run.world, -(-run.world // run.node_ranks)), argv
        assert _offloads(launch) == (run.offload_optimizer, run.offload_params), argv
        assert launch.mixed_precision == ("bf16" if run.dtype == "bf16" else "no"), argv
    parsed = vars(_sft_parser().parse_args(words[at + 1 :]))
    expected = {**settings.parallelism_config, "max_length": run.seq_len, **settings.training_arguments}
    parsed.update({key: _tiles(parsed[key]) for key in ("tiled_mlp", "tiled_layer")})
    assert {key: parsed[key] for key in expected} == expected, settings.slurm_command


@functools.cache
def _sft_parser():
    """recipes/sft.py's argument parser (its TrlParser over its own arguments and SFTConfig), built once."""
    from trl import SFTConfig, TrlParser

    sys.path.insert(0, str(REPO_ROOT / "recipes"))
    try:
        from sft import LongContextArguments
    finally:
        sys.path.remove(str(REPO_ROOT / "recipes"))
    return TrlParser((LongContextArguments, SFTConfig))


def _tiles(value: str | bool | int) -> bool | int:
    """A tile setting as recipes/sft.py reads it from its command line ("true", "false" or a count)."""
    text = str(value).lower()
    return text == "true" if text in ("true", "false") else int(text)


def _launched(launch) -> tuple[str, int, int]:
    """(engine, processes, machines) an `accelerate launch` resolves to, as the planner names engines."""
    if launch.use_deepspeed:
        engine = f"zero{launch.zero_stage}"
    elif launch.use_fsdp:
        engine = f"fsdp{launch.fsdp_version}"
    else:
        engine = "ddp" if launch.multi_gpu or launch.num_processes == 1 else "?"
    return engine, launch.num_processes, launch.num_machines


def _offloads(launch) -> tuple[bool, bool]:
    if launch.use_deepspeed:
        return launch.offload_optimizer_device == "cpu", launch.offload_param_device == "cpu"
    params = str(launch.fsdp_offload_params).lower() == "true" if launch.use_fsdp else False
    return False, params


@pytest.mark.parametrize("config", LAUNCH_CONFIGS, ids=lambda c: c.path)
def test_each_launch_config_is_what_the_planner_says(config):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(REPO_ROOT / config.path), "train.py"])
    launch, _, _ = _validate_launch_command(args)
    assert _launched(launch) == (config.engine, config.processes, config.machines)
    assert _offloads(launch) == (config.offload_optimizer, config.offload_params)


def test_the_readme_example_fits_and_shows_its_output(capsys):
    """The README's planner example is a plan that fits, its output is what the command prints, and it is the
    configuration the search suggests for the same run with default flags."""
    section = (REPO_ROOT / "README.md").read_text().split("## Does it fit? `hf-longctx plan`")[1].split("\n## ")[0]
    command, output = re.findall(r"```(?:bash|text)\n(.*?)```", section, re.S)[:2]
    argv = shlex.split(command.strip())[1:]
    assert main(argv) == 0
    assert capsys.readouterr().out == output
    default = argv[: argv.index("--sp")]
    _, out = _json(capsys, default)
    assert shlex.split(out["search"]["fits"]["plan_command"])[1:] == argv


@pytest.mark.parametrize("device", [["--gpu", "h200"], ["--gpu-memory", "60"]])
def test_the_printed_plan_command_keeps_the_device(capsys, device):
    """The search's plan command re-plans on the device asked for (not the default H100): same peak, fits."""
    code, out = _json(capsys, ["plan", "--model", "qwen3-4b", "--seq-len", "1048576", "--world", "8", *device])
    found = out["search"]["fits"]
    assert code == 1 and found is not None
    argv = shlex.split(found["plan_command"])[1:]
    assert argv[argv.index("--model") + 2 : argv.index("--model") + 4] == device, argv
    again_code, again = _json(capsys, argv)
    assert again_code == 0 and again["peak_gib"] == found["peak_gib"] and again["device"] == out["device"]


def test_an_sp_group_wider_than_a_node_is_warned_about_and_never_suggested(capsys):
    """Ulysses' all-to-alls over a group that spans nodes cross the inter-node network (issue 44): the plan says so,
    naming the hybrid backend, and the search keeps every group inside a node."""
    argv = ["plan", "--model", "llama3.1-8b", "--seq-len", "262144", "--world", "16", "--sp", "16", "--engine", "zero3"]
    code, out = _json(capsys, [*argv, "--activation-checkpointing", "--tiled-loss"])
    assert code == 0 and out["verdict"] == "fits"
    (warning,) = [w for w in out["warnings"] if "spans nodes" in w]
    assert 'sp_backend="auto"' in warning and "hybrid" in warning and "ring across nodes" in warning
    assert main([*argv, "--activation-checkpointing", "--tiled-loss"]) == 0
    assert "WARNING: an SP group of 16 ranks spans nodes of 8" in capsys.readouterr().out
    inside = _json(capsys, [*argv[:-4], "--sp", "8", "--engine", "zero3", "--activation-checkpointing"])[1]
    assert not [w for w in inside["warnings"] if "spans nodes" in w]
    # 4 ranks a node: SP 8 spans two; SP 3 of 12 ranks straddles a node boundary too.
    assert RunConfig(seq_len=8, world=8, sp=8, ranks_per_node=4).sp_spans_nodes
    assert RunConfig(seq_len=8, world=12, sp=3, ranks_per_node=4).sp_spans_nodes
    assert not RunConfig(seq_len=8, world=8, sp=4, ranks_per_node=4).sp_spans_nodes
    model = load_model_shape("llama3.1-8b")
    wide = RunConfig(seq_len=2_000_000, world=16, sp=16, engine="zero3")
    assert {c.sp for c in candidates(model, wide)} == {1, 2, 4, 8}
    best = search(model, wide, H100).best
    assert best is not None and not best.run.sp_spans_nodes and not best.plan.warnings


def test_a_multi_node_plan_prints_its_slurm_line_with_the_sp_size_it_plans(capsys):
    """Over two nodes the plan prints the Slurm template's line (its CONFIG: the engine planned, not the template's
    default) and, where the YAML's name says another SP size, that the SP size is the recipe's: issue 44."""
    argv = ["plan", "--model", "llama3.1-8b", "--seq-len", "524288", "--world", "16", "--sp", "4", "--engine", "zero3"]
    flags = ["--activation-checkpointing", "--tiled-loss", "--tiled-mlp", "--offload-activations"]
    code, out = _json(capsys, [*argv, *flags])
    assert code == 0 and "search" not in out
    slurm = out["launch"]["slurm_command"]
    assert (
        slurm.startswith("CONFIG=configs/2nodes_sp8.yaml RECIPE=") and " sbatch configs/slurm_2nodes.sbatch " in slurm
    )
    assert "--sp_size 4" in slurm and "--max_length 524288" in slurm and "--offload_activations true" in slurm
    assert (
        "sp_size=4" in out["launch"]["sp_size_note"]
        and "whatever the YAML's name says" in out["launch"]["sp_size_note"]
    )
    assert main([*argv, *flags]) == 0
    text = capsys.readouterr().out
    assert "to launch it:" in text and slurm in text and "--main_process_ip $MAIN_NODE_IP" in text
    code, eight = _json(capsys, [*argv[:-4], "--sp", "8", "--engine", "fsdp2", *flags])
    assert eight["launch"]["sp_size_note"] is None and eight["launch"]["slurm_command"].startswith(
        "CONFIG=configs/2nodes_fsdp2_sp8.yaml"
    )
    assert "launch" not in _json(capsys, ["plan", "--model", "llama3.1-8b", "--seq-len", "8192", "--world", "8"])[1]
    # A suggestion that needs accelerate flags the template does not set passes them as LAUNCH_FLAGS.
    run = RunConfig(seq_len=65536, world=16, sp=8, engine="zero3", offload_optimizer=True, dtype="fp32")
    line = settings_for("llama3.1-8b", run).slurm_command
    assert "'LAUNCH_FLAGS=--offload_optimizer_device cpu --mixed_precision no'" in line, line

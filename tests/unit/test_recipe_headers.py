"""Every GPU recipe can be run as it is: its header names the GPU, says it has not run on one yet, and its first
launch line names the engine with `--config_file`; the header's `hf-longctx plan` command plans exactly that launch
(GPU count and kind, engine and offload from the accelerate YAML, SP size, length, kernel and memory flags from the
recipe) and the planner says it fits with the planner's headroom (PLAN_ERROR), at the peak the header quotes."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hf_longctx.planner import PLAN_ERROR

ROOT = Path(__file__).resolve().parents[2]
GPU_RECIPES = [p for p in sorted((ROOT / "recipes").glob("*.yaml")) if not yaml.safe_load(p.read_text()).get("use_cpu")]
HEADROOM = PLAN_ERROR  # the planner's "fits": its measured error as headroom (docs/planner.md)
# recipe key -> the plan flag that models it
FLAGS = {
    "activation_checkpointing": "--activation-checkpointing",
    "tiled_loss": "--tiled-loss",
    "tiled_mlp": "--tiled-mlp",
    "tiled_layer": "--tiled-layer",
    "offload_activations": "--offload-activations",
}


def _header(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    return [line[1:].strip() for line in lines[: next(i for i, x in enumerate(lines) if not x.startswith("#"))]]


def _options(argv: list[str]) -> dict[str, str | None]:
    """`--key value` and bare `--flag` pairs of a command line."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def _engine(config: dict) -> tuple[str, set[str]]:
    """The plan's `--engine` and offload flags of an accelerate YAML."""
    kind = config["distributed_type"]
    if kind == "DEEPSPEED":
        ds = config["deepspeed_config"]
        offload = {"--offload-optimizer"} if ds.get("offload_optimizer_device") == "cpu" else set()
        offload |= {"--offload-params"} if ds.get("offload_param_device") == "cpu" else set()
        return f"zero{ds['zero_stage']}", offload
    if kind == "FSDP":
        return "fsdp2", {"--offload-params"} if config["fsdp_config"].get("fsdp_offload_params") else set()
    return "ddp", set()


def test_there_are_gpu_recipes():
    assert len(GPU_RECIPES) >= 7, [p.name for p in GPU_RECIPES]


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_first_launch_line_fits_the_gpu_the_header_names(path):
    header = _header(path)
    text = " ".join(header)
    assert "Not run on a GPU yet" in text, f"{path.name}: the header must say it has not run on a GPU yet"
    launch = next(line for line in header if line.startswith(("accelerate launch", "torchrun")))
    argv = shlex.split(launch)
    opts = _options(argv)
    assert launch.startswith("accelerate launch --config_file configs/"), f"{path.name}: {launch}"
    config = yaml.safe_load((ROOT / opts["--config_file"]).read_text())
    recipe = yaml.safe_load(path.read_text())
    count, gpu = re.search(r"(\d+) x (H100|H200|A100)", text).groups()
    world = int(opts.get("--num_processes") or config["num_processes"])  # accelerate's: all nodes' processes
    assert int(count) == world, f"{path.name}: the header names {count} GPUs, the launch starts {world} ranks"

    plan = re.search(r"Plan \(hf-longctx plan (.+?)\): ([\d.]+) of ([\d.]+) GiB", text)
    assert plan, f"{path.name}: no 'Plan (hf-longctx plan ...): X of Y GiB' in the header"
    plan_argv = shlex.split(plan.group(1))
    popts = _options(plan_argv)
    engine, offload = _engine(config)
    assert popts["--gpu"] == gpu.lower()
    assert int(popts.get("--world") or popts.get("--sp") or 1) == world
    assert int(popts.get("--sp") or 1) == recipe.get("sp_size", 1)
    assert popts.get("--engine", "ddp") == engine, f"{path.name}: the plan's engine is not {opts['--config_file']}'s"
    assert offload == {f for f in ("--offload-optimizer", "--offload-params") if f in popts}
    length = opts.get("--max_length") or recipe.get("max_length")
    if length is not None:
        assert int(popts["--seq-len"]) == int(length), f"{path.name}: the plan is not for the launched length"
    assert {f for key, f in FLAGS.items() if recipe.get(key)} == {f for f in FLAGS.values() if f in popts}
    attn = {"sdpa": "sdpa", "eager": "eager"}.get(recipe.get("attn_implementation"), "flash")
    assert popts.get("--attn", "flash") == attn

    done = subprocess.run(
        [sys.executable, "-m", "hf_longctx.cli", "plan", *plan_argv, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["fits"], f"{path.name}: {done.stdout[-500:]}"
    assert abs(result["peak_gib"] - float(plan.group(2))) < 0.01, f"{path.name}: the header quotes {plan.group(2)}"
    assert abs(result["capacity_gib"] - float(plan.group(3))) < 0.01
    fits = result["peak_gib"] <= (1 - HEADROOM) * result["capacity_gib"]
    assert fits, f"{path.name}: less than {HEADROOM:.0%} headroom"


CORPUS_TOKENS = 1_397_952  # one listing of the shipped texts in GPT-2 tokens (docs/trainers.md)
FEW_STEPS = 50


SHIPPED_TEXT_RECIPES = [p for p in GPU_RECIPES if yaml.safe_load(p.read_text()).get("long_documents")]


@pytest.mark.parametrize("path", SHIPPED_TEXT_RECIPES, ids=lambda p: p.name)
def test_a_recipe_of_few_steps_on_the_shipped_texts_says_it_is_a_smoke_test(path):
    """A `long_documents` recipe trains on the shipped texts cut into rows of `max_length`: a few rows, so a few
    optimizer steps. Its header must say so rather than read like a fine-tune."""
    recipe = yaml.safe_load(path.read_text())
    header = _header(path)
    launch = _options(shlex.split(next(line for line in header if line.startswith("accelerate launch"))))
    config = yaml.safe_load((ROOT / launch["--config_file"]).read_text())
    dp = int(launch.get("--num_processes") or config["num_processes"]) // recipe.get("sp_size", 1)
    length = int(launch.get("--max_length") or recipe["max_length"])
    rows = recipe.get("document_repeats", 1) * CORPUS_TOKENS // length
    steps = -(-rows // (dp * recipe.get("gradient_accumulation_steps", 1)))
    if steps < FEW_STEPS:
        assert "smoke test" in " ".join(header).lower(), f"{path.name}: about {steps} steps, not called a smoke test"

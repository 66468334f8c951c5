"""Every GPU launch line the project ships fits the hardware it says it runs on, by the project's own planner.

tests/unit/test_launch_lines.py checks each line's form; this file re-plans each GPU line of the same sources
(README.md, docs/*.md, the recipes' headers and the configs' comments, `documented_lines`) at its own settings and
fails on "does NOT fit" (a "tight" plan passes only where its recipe's header says it is tight). Torch-free
arithmetic: the whole file runs in about a second.

- **CPU lines are out of scope**: a line whose recipe, after the line's own arguments, sets `use_cpu: true` (the
  tiny recipes; their launch config, configs/cpu_sp2.yaml, is not a GPU config); and the library demo's line, which
  names no recipe (`EXECUTED_ELSEWHERE`).
- **The run**: the engine and its offloads from the `--config_file` YAML as the planner reads it
  (`settings.LAUNCH_CONFIGS`, which tests/unit/test_plan_search.py checks against accelerate), DDP for `torchrun`;
  for `sbatch configs/slurm_2nodes.sbatch`, `CONFIG` / `RECIPE` (the template's defaults unless set) and the nodes
  and GPUs per node of its `#SBATCH` lines. Processes: `--num_processes` or the YAML's (accelerate counts them over
  all machines), `--nnodes x --nproc_per_node` for torchrun; ranks per node: processes / machines. The recipe gives
  the model (`model_name_or_path`, matched to a planner config shipped in hf_longctx/data/model_configs, else the
  `--model` of its header's `hf-longctx plan`), `sp_size`, `bf16`, the attention kernel (`attn_implementation`;
  the scripts' default is sdpa), the memory flags and the batch, each overridden by the line's arguments after
  `--config`. Sequences per rank and step: `max_length` x `per_device_train_batch_size` for sft.py; chosen and
  rejected as two sequences of `max_length` for dpo.py and reward.py; for grpo.py a prompt of
  `GRPO_PROMPT_TOKENS` and `max_completion_length` per generation, `per_device_train_batch_size` of them.
- **The hardware**: the GPU a recipe's header names for that engine. In the header, each launch line runs on the
  last "N x H100|H200|A100" written before it; a line anywhere else (docs, README, configs, other headers) with the
  same recipe and engine (and offloads) runs on that GPU, with its own process count. A line whose engine its
  recipe's header does not launch fails: say in the header which GPU it needs first.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from hf_longctx.planner import DEVICES, LAUNCH_CONFIGS, RunConfig, estimate, load_model_shape, shipped_model_names
from tests.unit.test_launch_lines import EXECUTED_ELSEWHERE, SBATCH_TEMPLATE, _comment_lines, documented_lines

ROOT = Path(__file__).resolve().parents[2]
GPUS = {"H100": "h100", "H200": "h200", "A100": "a100-80"}
GPU_NAMED = re.compile(r"\b(\d+) x (H100|H200|A100)\b")
GRPO_PROMPT_TOKENS = 1024  # the prompt budget the GRPO recipe's header plans with (its dataset's prompts)
PAIRED_SCRIPTS = ("recipes/dpo.py", "recipes/reward.py")  # a row is a pair: chosen and rejected
ATTENTION = {"sdpa": "sdpa", "eager": "eager"}  # anything else (flash_attention_2 / _3) is the flash kernel
MEMORY_FLAGS = ("tiled_loss", "tiled_mlp", "tiled_layer", "offload_activations")
CONFIGS = {c.path: c for c in LAUNCH_CONFIGS}
Engine = tuple[str, bool, bool]  # (engine, offload_optimizer, offload_params)


@dataclass(frozen=True)
class Launch:
    """What one launch line starts: its recipe (overridden by the line's arguments), engine and ranks."""

    script: str
    recipe_path: str
    recipe: dict
    engine: Engine | None
    world: int
    node_ranks: int


def _value(text: str | None) -> object:
    """A command-line value as the recipe YAML would hold it (`--flag` alone is true)."""
    return True if text is None else yaml.safe_load(text)


def _arguments(words: list[str]) -> dict[str, object]:
    """`--key value` pairs (a bare `--flag` is true) of a launcher's or a script's arguments."""
    out: dict[str, object] = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            nxt = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
            out[word[2:]] = _value(nxt)
    return out


def _split(words: list[str]) -> tuple[dict[str, object], str, list[str]]:
    """Launcher flags, the script, and the script's arguments (those after the first `*.py`)."""
    at = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return _arguments(words[:at]), words[at], words[at + 1 :]


def _template_default(name: str) -> str:
    return re.search(rf"{name}=\$\{{{name}:-(\S+?)\}}", (ROOT / SBATCH_TEMPLATE).read_text()).group(1)


def _sbatch_option(name: str) -> str:
    return re.search(rf"^#SBATCH --{name}=(\S+)", (ROOT / SBATCH_TEMPLATE).read_text(), re.M).group(1)


def _engine(config: str) -> Engine:
    assert config in CONFIGS, f"{config}: the planner knows no engine for it (settings.LAUNCH_CONFIGS)"
    c = CONFIGS[config]
    return c.engine, c.offload_optimizer, c.offload_params


def parse_launch(line: str) -> Launch:
    """The recipe, engine and ranks of a launch line (one of test_launch_lines' forms)."""
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=\S+", w))
    words = words[len(env) :]
    if words[0] == "sbatch":
        nodes, per_node = int(_sbatch_option("nodes")), int(_sbatch_option("gpus-per-node"))
        config = env.get("CONFIG", _template_default("CONFIG"))
        script, args = "recipes/sft.py", ["--config", env.get("RECIPE", _template_default("RECIPE")), *words[2:]]
        engine, world = _engine(config), nodes * per_node
    elif words[0] == "torchrun":
        flags, script, args = _split(words[1:])
        per_node = int(flags.get("nproc_per_node", 1))
        engine, world = ("ddp", False, False), int(flags.get("nnodes", 1)) * per_node
    else:
        flags, script, args = _split(words[2:])
        config = CONFIGS.get(str(flags["config_file"]))
        world = int(flags.get("num_processes") or (config.processes if config else 1))
        machines = int(flags.get("num_machines") or (config.machines if config else 1))
        engine = _engine(config.path) if config else None  # None: not a GPU config (configs/cpu_sp2.yaml)
        per_node = world // machines
    overrides = _arguments(args)
    recipe_path = str(overrides.pop("config"))
    recipe = {**yaml.safe_load((ROOT / recipe_path).read_text()), **overrides}
    return Launch(script, recipe_path, recipe, engine, world, per_node)


def header_gpus(recipe_path: str) -> dict[Engine, str]:
    """Engine -> the GPU the recipe's header launches it on (the last "N x GPU" before its first line)."""
    gpus: dict[Engine, str] = {}
    named = None
    for line in _comment_lines((ROOT / recipe_path).read_text()):
        named = (GPU_NAMED.findall(line) or [(None, named)])[-1][1]
        if line.startswith(("accelerate launch", "torchrun")) and named:
            gpus.setdefault(parse_launch(line).engine, named)
    return gpus


def _model(launch: Launch) -> str:
    """The planner config of the recipe's model: a shipped one by name, else its header's `--model`."""
    wanted = re.sub(r"[^a-z0-9.]", "", str(launch.recipe.get("model_name_or_path", "")).split("/")[-1].lower())
    for name in shipped_model_names():
        if re.sub(r"[^a-z0-9.]", "", name) == wanted:
            return name
    header = re.search(r"hf-longctx plan --model (\S+)", (ROOT / launch.recipe_path).read_text())
    assert header, f"{launch.recipe_path}: no planner config for {wanted!r}; ship one or name it in the header's plan"
    return header.group(1)


def run_config(launch: Launch) -> RunConfig:
    """The planner's run for a launch line."""
    r = launch.recipe
    batch = int(r.get("per_device_train_batch_size", 1))
    if launch.script == "recipes/grpo.py":
        seq_len = GRPO_PROMPT_TOKENS + int(r["max_completion_length"])
    else:
        seq_len, batch = int(r["max_length"]), batch * (2 if launch.script in PAIRED_SCRIPTS else 1)
    engine, offload_optimizer, offload_params = launch.engine
    backend = r.get("sp_backend", "ulysses")
    assert backend == "ulysses", f"{launch.recipe_path}: the planner models Ulysses only, not {backend}"
    return RunConfig(
        seq_len=seq_len,
        world=launch.world,
        sp=int(r.get("sp_size", 1)),
        micro_batch=batch,
        engine=engine,
        dtype="bf16" if r.get("bf16") else "fp32",
        attn=ATTENTION.get(r.get("attn_implementation", "sdpa"), "flash"),
        gradient_checkpointing=bool(r.get("gradient_checkpointing") or r.get("activation_checkpointing")),
        **{key: r.get(key, False) for key in MEMORY_FLAGS},
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
        ranks_per_node=launch.node_ranks,
        ulysses_head_chunks=int(r.get("ulysses_head_chunks", 1)),
    )


def gpu_lines() -> list[tuple[str, str]]:
    """(file, line) for every GPU launch line: all documented lines but the CPU ones (module docstring)."""
    out = []
    for source, line in documented_lines():
        if line in EXECUTED_ELSEWHERE or parse_launch(line).recipe.get("use_cpu"):
            continue
        out.append((source, line))
    return out


def plan_line(line: str):
    """The plan of a launch line on the GPU its recipe's header names for its engine, and that GPU."""
    launch = parse_launch(line)
    assert launch.engine is not None, f"{line}: its --config_file is not one the planner knows (LAUNCH_CONFIGS)"
    gpus = header_gpus(launch.recipe_path)
    assert launch.engine in gpus, (
        f"{launch.recipe_path}'s header launches no {launch.engine} run, so the line names no GPU: add one there "
        f"(header engines: {sorted(gpus)})"
    )
    return estimate(load_model_shape(_model(launch)), run_config(launch), DEVICES[GPUS[gpus[launch.engine]]])


def test_the_gpu_lines_are_found():
    lines = [line for _, line in gpu_lines()]
    assert len(lines) >= 20, lines
    for form in ("torchrun --nnodes 2", "sbatch configs/slurm_2nodes.sbatch", "--machine_rank", "zero3_offload_1gpu"):
        assert any(form in line for line in lines), form
    assert not any("tiny_" in line for line in lines)  # the CPU recipes


@pytest.mark.parametrize(("source", "line"), gpu_lines(), ids=lambda v: v[:60])
def test_every_gpu_launch_line_fits_where_it_says_it_runs(source, line):
    plan = plan_line(line)
    verdict = plan.verdict()
    assert verdict != "does NOT fit", f"{source}: {line}\n  planned {plan.peak_gib:.2f} of {plan.capacity_gib:.2f} GiB"
    if verdict == "tight":
        header = (ROOT / parse_launch(line).recipe_path).read_text()
        assert "tight" in header, f"{source}: {line} is tight ({plan.peak_gib:.2f} GiB) and its header does not say so"


DDP_8B_ON_H100 = "torchrun --nproc_per_node 8 recipes/sft.py --config recipes/llama31_8b_512k_sp8.yaml"
DDP_4B = "accelerate launch --config_file configs/ddp_sp4.yaml recipes/sft.py --config recipes/qwen3_4b_128k_sp4.yaml"


# The first: DDP holds the fp32 states of all 8B parameters on every GPU (docs/launch.md showed it until issue 44).
@pytest.mark.parametrize(("line", "gpu"), [(DDP_8B_ON_H100, None), (DDP_4B, "H200")])
def test_a_line_that_does_not_fit_or_names_no_gpu_fails(line, gpu):
    launch = parse_launch(line)
    if gpu is None:  # the header launches no DDP run: no GPU named
        with pytest.raises(AssertionError, match="names no GPU"):
            plan_line(line)
        return
    assert header_gpus(launch.recipe_path)[launch.engine] == gpu
    on_h100 = estimate(load_model_shape(_model(launch)), run_config(launch), DEVICES["h100"])
    assert on_h100.verdict() == "does NOT fit"  # the same line on the header's H100 would fail


def test_a_line_is_planned_at_its_own_arguments_and_ranks():
    line = (
        "torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint h:29500 --rdzv_id a "
        "recipes/sft.py --config recipes/qwen3_4b_128k_sp4.yaml --max_length 65536 --sp_size 8 --tiled_loss false"
    )
    run = run_config(parse_launch(line))
    assert (run.world, run.node_ranks, run.sp, run.seq_len, run.engine, run.tiled_loss) == (
        16, 8, 8, 65536, "ddp", False)  # fmt: skip
    slurm = parse_launch("CONFIG=configs/2nodes_sp8.yaml sbatch configs/slurm_2nodes.sbatch --max_length 1024")
    assert (slurm.engine, slurm.world, slurm.node_ranks, slurm.recipe["max_length"]) == (
        ("zero3", False, False), 16, 8, 1024)  # fmt: skip


def test_the_slurm_template_asks_for_the_host_memory_and_cpus_its_lines_need():
    """The template's lines offload activations to pinned host memory (128 GiB per node for its default recipe):
    `--mem` must cover the plan's host RAM per node (`--mem=0`: all of it), and the one task per node that runs
    every rank gets CPUs of its own, handed on to srun."""
    template = (ROOT / SBATCH_TEMPLATE).read_text()
    mem = _sbatch_option("mem")
    for _, line in gpu_lines():
        if "sbatch" in line.split()[:2]:
            plan = plan_line(line)
            assert plan.host_gib > 0  # the recipe offloads: without a memory request Slurm may give a node little
            if mem != "0":
                assert float(mem.rstrip("G")) >= plan.host_gib, (mem, plan.host_gib)
    assert int(_sbatch_option("cpus-per-task")) >= int(_sbatch_option("gpus-per-node"))
    assert "SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK" in template  # srun of Slurm 22.05+ does not inherit it

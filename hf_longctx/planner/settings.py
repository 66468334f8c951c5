"""The settings that run a planned configuration: `settings_for(model_arg, run)`.

Why: a plan is only useful when it ends in what to type. Each `RunConfig` field maps to one real setting: a
`TrainingArguments` / `SFTConfig` field, an `hf_longctx.ParallelismConfig` field, a model config attribute, or the
accelerate launch config in configs/ (the engine and its offloads) with `accelerate launch` flags where the YAML
differs (process count, nodes, offload devices, mixed precision); over several nodes also the `sbatch` line of
configs/slurm_2nodes.sbatch, which runs recipes/sft.py with the settings as its arguments. `LAUNCH_CONFIGS` describes
the shipped YAMLs; tests/unit/test_plan_search.py reads each one and checks the engine, offloads and process counts
named here, and that every field and flag exists. `--liger-kernels` maps to no hf_longctx setting, so `settings_for`
refuses it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from hf_longctx.planner.run import RunConfig

SCRIPT = "your_training_script.py"  # the user's script in the printed launch line (recipes/sft.py for the recipes)
SLURM_TEMPLATE = "configs/slurm_2nodes.sbatch"  # runs recipes/sft.py on every node; CONFIG, RECIPE and LAUNCH_FLAGS
RECIPE = "your_recipe.yaml"  # the recipe (model, data) in the printed Slurm line
SLURM_NODES, SLURM_GPUS_PER_NODE = 2, 8  # the template's `#SBATCH --nodes` / `--gpus-per-node`
TEMPLATE_FLAGS = ("--num_processes", "--num_machines", "--machine_rank", "--main_process_ip")  # set from the allocation


@dataclass(frozen=True)
class LaunchConfig:
    """A shipped accelerate YAML: the engine it configures, its offloads, processes and machines."""

    path: str
    engine: str
    processes: int
    machines: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False


LAUNCH_CONFIGS: tuple[LaunchConfig, ...] = (
    LaunchConfig("configs/ddp_sp4.yaml", "ddp", 4),
    LaunchConfig("configs/zero3_sp8.yaml", "zero3", 8),
    LaunchConfig("configs/fsdp2_sp8.yaml", "fsdp2", 8),
    LaunchConfig("configs/zero3_offload_1gpu.yaml", "zero3", 1, offload_optimizer=True, offload_params=True),
    LaunchConfig("configs/2nodes_sp8.yaml", "zero3", 16, machines=2),
    LaunchConfig("configs/2nodes_fsdp2_sp8.yaml", "fsdp2", 16, machines=2),
)


@dataclass(frozen=True)
class Settings:
    """What to set for a planned run.

    training_arguments: `TrainingArguments` / `SFTConfig` fields (besides `parallelism_config`).
    parallelism_config: `hf_longctx.ParallelismConfig` fields (defaults left out).
    model_config: attributes of the model's config (e.g. `output_router_logits` for `--router-loss`).
    launch_config: the accelerate YAML under configs/; launch_flags: `accelerate launch` flags that adapt it.
    plan_command: the `hf-longctx plan` command that plans exactly this run.
    slurm_command: over several nodes, the `sbatch` line of configs/slurm_2nodes.sbatch (None on one node, or when a
        setting has no recipes/sft.py argument: `ulysses_head_chunks`, the model config's).
    sp_size_note: why the YAML's name may say another SP size than the one planned (None when they agree).
    """

    training_arguments: dict[str, Any]
    parallelism_config: dict[str, Any]
    model_config: dict[str, Any]
    launch_config: str
    launch_flags: tuple[str, ...]
    plan_command: str
    slurm_command: str | None = None
    sp_size_note: str | None = None

    @property
    def launch_command(self) -> str:
        """The `accelerate launch` line (run on every node, with its own `--machine_rank`, when multi-node)."""
        return " ".join(["accelerate", "launch", "--config_file", self.launch_config, *self.launch_flags, SCRIPT])

    def python(self) -> tuple[str, str]:
        """`TrainingArguments(...)` / `SFTConfig(...)` keywords as Python: the fields, then `parallelism_config=`."""
        fields = ", ".join(f"{k}={v!r}" for k, v in self.training_arguments.items())
        parallel = ", ".join(f"{k}={v!r}" for k, v in self.parallelism_config.items())
        return fields, f"parallelism_config=hf_longctx.ParallelismConfig({parallel})"


def launch_config(run: RunConfig) -> LaunchConfig:
    """The shipped YAML closest to `run`: same engine and single- or multi-node, then the same offloads, then the
    same number of processes (the rest is adapted by `launch_flags`)."""
    multi_node = run.world > run.node_ranks
    options = [c for c in LAUNCH_CONFIGS if c.engine == run.engine and (c.machines > 1) == multi_node]
    if not options:  # no multi-node YAML for this engine: the single-node one, with --num_machines
        options = [c for c in LAUNCH_CONFIGS if c.engine == run.engine]
    if not options:
        raise ValueError(f"no launch config in configs/ runs --engine {run.engine}; plan with ddp, zero3 or fsdp2.")

    def distance(config: LaunchConfig) -> tuple[int, int]:
        offloads = (config.offload_optimizer, config.offload_params) != (run.offload_optimizer, run.offload_params)
        return int(offloads), int(config.processes != run.world)

    return min(options, key=distance)


def launch_flags(run: RunConfig, config: LaunchConfig) -> tuple[str, ...]:
    """`accelerate launch` flags that turn `config` into `run` (they override the YAML's values)."""
    flags: list[str] = []
    machines = -(-run.world // run.node_ranks)
    if run.world != config.processes:
        flags += ["--num_processes", str(run.world)]
    if machines != config.machines:
        flags += ["--num_machines", str(machines)]
    if machines > 1:
        flags += ["--machine_rank", "$NODE_RANK", "--main_process_ip", "$MAIN_NODE_IP"]
    if run.engine.startswith("zero"):
        for flag, on, shipped in (
            ("--offload_optimizer_device", run.offload_optimizer, config.offload_optimizer),
            ("--offload_param_device", run.offload_params, config.offload_params),
        ):
            if on != shipped:
                flags += [flag, "cpu" if on else "none"]
    elif run.engine == "fsdp2" and run.offload_params != config.offload_params:
        flags += ["--fsdp_offload_params", "true" if run.offload_params else "false"]
    if run.dtype == "fp32":
        flags += ["--mixed_precision", "no"]
    return tuple(flags)


def recipe_arguments(run: RunConfig, training: dict[str, Any], parallel: dict[str, Any]) -> list[str] | None:
    """The settings as recipes/sft.py arguments (TrlParser's `--field value`), or None where one has none."""
    if "ulysses_head_chunks" in parallel:
        return None
    words = ["--max_length", str(run.seq_len)]
    for key, value in {**training, **parallel}.items():
        words += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return words


def slurm_command(run: RunConfig, config: LaunchConfig, flags: tuple[str, ...], recipe: list[str] | None) -> str | None:
    """The `sbatch` line of the Slurm template for a multi-node run: its YAML as CONFIG, the launch flags the template
    does not set itself as LAUNCH_FLAGS, the allocation where it differs from the template's, the recipe arguments."""
    machines = -(-run.world // run.node_ranks)
    if machines < 2 or recipe is None or machines * run.node_ranks != run.world:
        return None
    pairs = [(flags[i], flags[i + 1]) for i in range(0, len(flags), 2)]
    extra = " ".join(f"{flag} {value}" for flag, value in pairs if flag not in TEMPLATE_FLAGS)
    words = [f"CONFIG={config.path}", f"RECIPE={RECIPE}"] + ([shlex.quote(f"LAUNCH_FLAGS={extra}")] if extra else [])
    words.append("sbatch")
    if machines != SLURM_NODES:
        words.append(f"--nodes={machines}")
    if run.node_ranks != SLURM_GPUS_PER_NODE:
        words.append(f"--gpus-per-node={run.node_ranks}")
    return " ".join([*words, SLURM_TEMPLATE, *recipe])


def sp_size_note(run: RunConfig, config: LaunchConfig) -> str | None:
    """A note when the YAML's name says another SP size (`_sp8`): the YAML sets the engine and processes only."""
    named = re.search(r"_sp(\d+)\.yaml$", config.path)
    if named is None or int(named.group(1)) == run.sp:
        return None
    return (
        f"{config.path} sets the engine and the process count only: the SP size is sp_size={run.sp} "
        f"(recipes/sft.py: --sp_size {run.sp}; a recipe's sp_size: {run.sp}), whatever the YAML's name says"
    )


def plan_flags(run: RunConfig) -> list[str]:
    """The `hf-longctx plan` flags that describe `run` (defaults left out)."""
    flags = ["--seq-len", str(run.seq_len), "--world", str(run.world), "--sp", str(run.sp)]
    valued = (("--engine", run.engine, "ddp"), ("--dtype", run.dtype, "bf16"), ("--attn", run.attn, "flash"),
              ("--micro-batch", run.micro_batch, 1), ("--ulysses-head-chunks", run.ulysses_head_chunks, 1),
              ("--host-memory", run.host_memory_gib, None), ("--ranks-per-node", run.ranks_per_node, None),
              ("--vision-patches", run.vision_patches, 0), ("--sp-backend", run.sp_backend, "ulysses"))  # fmt: skip
    for flag, value, default in valued:
        if value != default:
            flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    for flag, value in (("--tiled-mlp", run.tiled_mlp), ("--tiled-layer", run.tiled_layer)):
        if value is not False:
            flags += [flag] if value is True else [flag, str(value)]
    switches = (("--activation-checkpointing", run.gradient_checkpointing), ("--tiled-loss", run.tiled_loss),
                ("--offload-activations", run.offload_activations), ("--offload-optimizer", run.offload_optimizer),
                ("--offload-params", run.offload_params), ("--router-loss", run.router_loss))  # fmt: skip
    return flags + [flag for flag, on in switches if on]


def settings_for(model_arg: str, run: RunConfig, device_flags: tuple[str, ...] = ()) -> Settings:
    """Every setting `run` needs, for the model given as `model_arg` (as typed to `--model`) on the device that
    `device_flags` names (`--gpu NAME` / `--gpu-memory GIB` as typed; none: the default profile).

    Raises:
        ValueError: `run.liger_kernels` (no hf_longctx setting turns Liger's kernels on) or an engine without a
            launch config in configs/.
    """
    if run.liger_kernels:
        raise ValueError("--liger-kernels maps to no hf_longctx setting; plan without it to get settings to use.")
    training: dict[str, Any] = {"per_device_train_batch_size": run.micro_batch, "bf16": run.dtype == "bf16"}
    if run.gradient_checkpointing:  # transformers 5.25 deprecates gradient_checkpointing (gone in v6)
        training["activation_checkpointing"] = True
    parallel: dict[str, Any] = {"sp_size": run.sp}
    if run.sp_backend != "ulysses":
        parallel["sp_backend"] = run.sp_backend
    for key in ("tiled_loss", "tiled_mlp", "tiled_layer", "offload_activations"):
        if getattr(run, key) is not False:
            parallel[key] = getattr(run, key)
    if run.ulysses_head_chunks > 1:
        parallel["ulysses_head_chunks"] = run.ulysses_head_chunks
    config = launch_config(run)
    flags = launch_flags(run, config)
    words = ["hf-longctx", "plan", "--model", model_arg, *device_flags, *plan_flags(run)]
    command = " ".join(shlex.quote(w) for w in words)
    recipe = None if run.router_loss else recipe_arguments(run, training, parallel)
    return Settings(
        training_arguments=training,
        parallelism_config=parallel,
        model_config={"output_router_logits": True} if run.router_loss else {},
        launch_config=config.path,
        launch_flags=flags,
        plan_command=command,
        slurm_command=slurm_command(run, config, flags, recipe),
        sp_size_note=sp_size_note(run, config),
    )

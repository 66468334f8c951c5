"""`hf-longctx plan`: per-rank peak memory and the longest trainable sequence, before launching.

`add_arguments` defines the flags, `run` prints the plan (a table, or one JSON object with `--json`) and, when it
does not fit with the planner's error as headroom, the cheapest configuration that does, as the settings to use.
The numbers come from `planner.estimate` / `planner.max_seq_len` / `planner.search`; nothing is launched or
downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hf_longctx.planner.devices import DEVICES, DeviceProfile
from hf_longctx.planner.estimate import PLAN_ERROR, Plan, estimate, max_seq_len
from hf_longctx.planner.model_shape import load_model_shape, shipped_model_names
from hf_longctx.planner.run import ATTNS, DTYPES, ENGINES, SP_BACKENDS, UNMODELLED_BACKENDS, RunConfig
from hf_longctx.planner.search import SearchResult, search
from hf_longctx.planner.settings import SLURM_TEMPLATE, Settings, settings_for

EXIT_CODES = {"fits": 0, "tight": 3}  # anything else: 1 (does not fit); 2: invalid input

GENERIC_GPU = DeviceProfile("gpu", 0.0, DEVICES["h100"].runtime_gib, DEVICES["h100"].fragmentation)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` subcommand's flags."""
    parser.add_argument(
        "--model",
        required=True,
        help=f"config.json, a model folder, a shipped name ({shipped_model_names()}) or a Hub id (Org/Name: "
        "the Hugging Face cache, else the Hub)",
    )
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence (S)")
    parser.add_argument("--world", type=int, default=None, help="ranks in all (default: --sp)")
    parser.add_argument("--sp", type=int, default=1, help="ranks that split one sequence (Ulysses SP degree)")
    parser.add_argument(
        "--sp-backend",
        choices=(*SP_BACKENDS, *UNMODELLED_BACKENDS),
        default="ulysses",
        help=f"SP backend (default ulysses); modelled: {', '.join(SP_BACKENDS)}; "
        f"not modelled (refused): {', '.join(UNMODELLED_BACKENDS)}",
    )
    device = parser.add_mutually_exclusive_group()
    device.add_argument("--gpu", choices=sorted(DEVICES), default="h100", help="device profile (default h100)")
    device.add_argument("--gpu-memory", type=float, metavar="GIB", help="a GPU with this many GiB instead")
    parser.add_argument("--engine", choices=ENGINES, default="ddp", help="data-parallel engine (default ddp)")
    parser.add_argument("--offload-optimizer", action="store_true", help="DeepSpeed optimizer states on the CPU")
    parser.add_argument("--offload-params", action="store_true", help="ZeRO-3 / FSDP2 parameters on the CPU")
    parser.add_argument(
        "--activation-checkpointing",
        "--gradient-checkpointing",  # the old name: transformers 5.25 deprecates it in TrainingArguments
        dest="gradient_checkpointing",
        action="store_true",
        help="keep one hidden state per layer (TrainingArguments' activation_checkpointing; "
        "--gradient-checkpointing is the old name)",
    )
    parser.add_argument("--tiled-loss", action="store_true", help="LM head + cross-entropy in chunks")
    parser.add_argument(
        "--tiled-mlp",
        nargs="?",
        const=True,
        default=False,
        type=int,
        metavar="N",
        help="MLP over sequence tiles (N tiles; default ceil(tokens / hidden))",
    )
    parser.add_argument(
        "--tiled-layer",
        nargs="?",
        const=True,
        default=False,
        type=int,
        metavar="N",
        help="every token-local part of each decoder layer over sequence tiles, attention per query tile "
        "(N tiles; default ceil(tokens / max(hidden, 4096)); subsumes --tiled-mlp)",
    )
    parser.add_argument("--offload-activations", action="store_true", help="checkpointed layer inputs on the host")
    parser.add_argument(
        "--ulysses-head-chunks",
        type=int,
        default=1,
        metavar="C",
        help="Ulysses exchange + attention over C chunks of each rank's heads (default 1: all at once)",
    )
    parser.add_argument(
        "--host-memory",
        type=float,
        metavar="GIB",
        help="host RAM per node for offloaded activations and model states; refused when they do not fit "
        "(default: unlimited)",
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=None, help="ranks sharing one node's host RAM (default: min(world, 8))"
    )
    parser.add_argument(
        "--liger-kernels",
        action="store_true",
        help="model Liger's RMSNorm/SwiGLU/RoPE/fused loss as ALST ran them (to compare with its published runs); "
        "no hf_longctx setting turns them on, so the search plans without them",
    )
    parser.add_argument("--router-loss", action="store_true", help="MoE: train with the router load-balancing loss on")
    parser.add_argument(
        "--vision-patches",
        type=int,
        default=0,
        help="VLM (a --model config with a vision_config): patches of every image and frame per micro-batch, "
        "before the merge; the vision tower runs sharded over the SP group",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--attn", choices=ATTNS, default="flash", help="attention kernel (default flash)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument(
        "--max-seq", action="store_true", help="also bisect the longest S that fits (with the headroom; at capacity)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def device_profile(args: argparse.Namespace) -> DeviceProfile:
    """The chosen profile; `--gpu-memory` gives a generic GPU, `--gpu cpu` this machine's RAM."""
    if args.gpu_memory is not None:
        if args.gpu_memory <= 0:
            raise ValueError(f"--gpu-memory must be > 0 GiB, got {args.gpu_memory}.")
        return GENERIC_GPU.with_capacity(args.gpu_memory)
    profile = DEVICES[args.gpu]
    if profile.host_is_device:
        return profile.with_capacity(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30)
    return profile


def device_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The device flags as typed (none for the default profile), for the plan commands the search prints."""
    if args.gpu_memory is not None:
        return ("--gpu-memory", f"{args.gpu_memory:g}")
    return ("--gpu", args.gpu) if args.gpu != "h100" else ()


def run_config(args: argparse.Namespace) -> RunConfig:
    """The `RunConfig` the flags describe."""
    return RunConfig(
        seq_len=args.seq_len,
        world=args.world if args.world is not None else args.sp,
        sp=args.sp,
        micro_batch=args.micro_batch,
        engine=args.engine,
        dtype=args.dtype,
        attn=args.attn,
        gradient_checkpointing=args.gradient_checkpointing,
        tiled_loss=args.tiled_loss,
        tiled_mlp=args.tiled_mlp,
        tiled_layer=args.tiled_layer,
        offload_activations=args.offload_activations,
        offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params,
        liger_kernels=args.liger_kernels,
        sp_backend=args.sp_backend,
        ranks_per_node=args.ranks_per_node,
        host_memory_gib=args.host_memory,
        ulysses_head_chunks=args.ulysses_head_chunks,
        router_loss=args.router_loss,
        vision_patches=args.vision_patches,
    )


def run(args: argparse.Namespace) -> int:
    """Print the plan, and the cheapest configuration that fits when it does not; exit 0 when it fits with the
    planner's error as headroom, 3 when it fits by less ("tight"), 1 when it does not fit, 2 on invalid input."""
    try:
        model = load_model_shape(args.model)
        config = run_config(args)
        device = device_profile(args)
        plan = estimate(model, config, device)
        if args.max_seq:
            plan = Plan(**{**plan.__dict__, "max_seq": max_seq_len(model, config, device)})
        longest = max_seq_len(model, config, device, margin=PLAN_ERROR) if args.max_seq else None
        # The search ends in GPU launch settings: the CPU profile is for checking the model against CPU runs.
        found = search(model, config, device) if plan.verdict() != "fits" and not device.host_is_device else None
        settings = multi_node_settings(args, config, plan) if not device.host_is_device else None
    except ValueError as exc:
        print(f"hf-longctx plan: error: {exc}", file=sys.stderr)
        return 2
    if plan.host_capacity_gib is not None and plan.host_gib > plan.host_capacity_gib:
        print(f"hf-longctx plan: error: {plan.notes[-1]}", file=sys.stderr)
    if args.json:
        out: dict[str, Any] = {"model": model.name, "device": device.name, "run": vars(config), **plan.as_dict()}
        if longest is not None:
            out["max_seq_fits"] = longest
        if found is not None:
            out["search"] = search_dict(args.model, found, device_flags(args))
        if settings is not None:
            out["launch"] = {key: getattr(settings, key) for key in ("launch_command", "slurm_command", "sp_size_note")}
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan, model.name, config, device, longest))
        if settings is not None:
            print("\n".join(["  to launch it:", *(f"    {line}" for line in launch_lines(settings, config))]))
        if found is not None:
            print(format_search(args.model, found, config, device_flags(args)))
    return EXIT_CODES.get(plan.verdict(), 1)


def format_plan(plan: Plan, model_name: str, run: RunConfig, device: DeviceProfile, longest: int | None = None) -> str:
    """The human-readable table; `longest`: the longest sequence that fits with the headroom (`--max-seq`)."""
    flags = [
        name
        for name, on in (
            ("activation checkpointing", run.gradient_checkpointing),
            ("tiled loss", run.tiled_loss),
            (f"tiled MLP ({'auto' if run.tiled_mlp is True else run.tiled_mlp} tiles)", run.tiled_mlp),
            (f"tiled layer ({'auto' if run.tiled_layer is True else run.tiled_layer} tiles)", run.tiled_layer),
            ("offloaded activations", run.offload_activations),
            (f"{run.ulysses_head_chunks} Ulysses head chunks", run.ulysses_head_chunks > 1),
            ("offloaded optimizer", run.offload_optimizer),
            ("offloaded parameters", run.offload_params),
            ("Liger kernels", run.liger_kernels),
        )
        if on
    ]
    lines = [
        f"hf-longctx plan: {model_name} ({plan.num_params / 1e9:.2f}B parameters), S = {run.seq_len:,} tokens, "
        f"world {run.world}, SP {run.sp}, micro-batch {run.micro_batch} -> {plan.tokens_per_rank:,} tokens per rank",
        f"  {run.engine}, {run.dtype}, {run.attn} attention" + (", " + ", ".join(flags) if flags else ""),
        f"  attention kernel: {plan.attention_kernel}",
        f"  device {device.name}: {plan.capacity_gib:.2f} GiB; SP backend {run.sp_backend} (modelled: "
        f"{', '.join(SP_BACKENDS)}; not modelled: {', '.join(UNMODELLED_BACKENDS)})",
        f"  host RAM per node (offloaded activations and states, {run.node_ranks} ranks): {plan.host_gib:.2f} GiB, "
        "limit " + ("none (--host-memory)" if plan.host_capacity_gib is None else f"{plan.host_capacity_gib:g} GiB"),
        "",
        f"  {'term (at the peak phase)':32s} {'GiB':>9s}",
    ]
    for term, gib in plan.breakdown.items():
        lines.append(f"  {term.replace('_', ' '):32s} {gib:9.2f}")
    share = plan.breakdown[plan.dominant] / plan.peak_gib if plan.peak_gib else 0.0
    lines += [
        f"  {'-' * 42}",
        f"  {'peak (' + plan.peak_phase + ' phase)':32s} {plan.peak_gib:9.2f}  of {plan.capacity_gib:.2f}: "
        + verdict_text(plan),
        f"  dominant term: {plan.dominant.replace('_', ' ')} ({100 * share:.0f}% of the peak)",
        f'  "fits" needs {100 * PLAN_ERROR:.0f}% headroom, the planner\'s largest measured error (docs/planner.md); '
        'less is "tight"',
    ]
    if plan.max_seq is not None:
        lines.append(f"  longest sequence that fits: {longest:,} tokens ({plan.max_seq:,} at the device's capacity)")
    if run.liger_kernels:
        lines.append("  note: --liger-kernels models ALST's Liger kernels; no hf_longctx setting turns them on")
    lines += [f"  note: {note}" for note in plan.notes]
    lines += [f"  WARNING: {warning}" for warning in plan.warnings]
    return "\n".join(lines)


def multi_node_settings(args: argparse.Namespace, run: RunConfig, plan: Plan) -> Settings | None:
    """The launch settings of a multi-node run that fits (or is tight): how to start it on every node, and under
    Slurm. None on one node, when it does not fit (the search prints a configuration that does) or when no shipped
    launch config runs it (ZeRO-1/2, Liger's kernels)."""
    if run.world <= run.node_ranks or plan.verdict() not in ("fits", "tight"):
        return None
    try:
        return settings_for(args.model, run, device_flags(args))
    except ValueError:
        return None


def launch_lines(settings: Settings, run: RunConfig) -> list[str]:
    """The `accelerate launch` line and, over several nodes, where it runs and the Slurm template's `sbatch` line."""
    lines = [settings.launch_command]
    if run.world > run.node_ranks:
        lines.append("(on every node, with its own NODE_RANK and the first node's address as MAIN_NODE_IP)")
        if settings.slurm_command is not None:
            lines.append(f"under Slurm, from the repository's root: {settings.slurm_command}")
        else:
            lines.append(f"(no {SLURM_TEMPLATE} line: its recipes/sft.py has no argument for every setting above)")
    if settings.sp_size_note is not None:
        lines.append(f"({settings.sp_size_note})")
    return lines


def verdict_text(plan: Plan) -> str:
    """The verdict with the headroom it leaves, or how far over the device it is."""
    if plan.peak_gib > plan.capacity_gib:
        return f"{plan.verdict()} ({plan.peak_gib - plan.capacity_gib:.2f} GiB over)"
    return f"{plan.verdict()} ({100 * plan.headroom:.0f}% headroom)"


def format_search(model_arg: str, found: SearchResult, asked: RunConfig, device: tuple[str, ...] = ()) -> str:
    """The cheapest configuration that fits, as the settings to use; or, if none does, the lowest peak planned."""
    searched = f"planned {found.planned:,} of {found.candidates:,}: engine, offloads, SP size, memory flags"
    if found.best is None:
        lines = [f"  no configuration fits with {100 * PLAN_ERROR:.0f}% headroom ({searched})"]
        if found.lowest is not None:
            lowest = found.lowest.plan
            lines += [
                f"  lowest peak: {lowest.peak_gib:.2f} GiB, {verdict_text(lowest)}:",
                f"    {settings_for(model_arg, found.lowest.run, device).plan_command}",
            ]
        lines.append("  use more GPUs (--world), a shorter --seq-len, or more --host-memory where offloads need it")
        return "\n".join(lines)
    best = found.best
    settings = settings_for(model_arg, best.run, device)
    lines = [
        f"  cheapest configuration that fits ({searched}; cheapest first, docs/planner.md):",
        f"    peak {best.plan.peak_gib:.2f} of {best.plan.capacity_gib:.2f} GiB, {100 * best.plan.headroom:.0f}% "
        f"headroom; host RAM {best.plan.host_gib:.2f} GiB per node",
        f"    {settings.plan_command}",
        "    TrainingArguments / SFTConfig: {},\n        {}".format(*settings.python()),
    ]
    if settings.model_config:
        lines.append("    model config: " + ", ".join(f"{k}={v!r}" for k, v in settings.model_config.items()))
    lines += [f"    {line}" for line in launch_lines(settings, best.run)]
    if asked.liger_kernels:
        lines.append("    (planned without --liger-kernels: no hf_longctx setting turns them on)")
    return "\n".join(lines)


def search_dict(model_arg: str, found: SearchResult, device: tuple[str, ...] = ()) -> dict[str, Any]:
    """The search for `--json`: the configuration that fits (or null) with its settings, and the lowest peak."""
    out: dict[str, Any] = {"planned": found.planned, "candidates": found.candidates, "fits": None}
    if found.best is not None:
        best, settings = found.best, settings_for(model_arg, found.best.run, device)
        out["fits"] = {
            "run": vars(best.run),
            "peak_gib": best.plan.peak_gib,
            "headroom": round(best.plan.headroom, 4),
            "host_gib": best.plan.host_gib,
            "cost": best.cost,
            "training_arguments": settings.training_arguments,
            "parallelism_config": settings.parallelism_config,
            "model_config": settings.model_config,
            "launch_config": settings.launch_config,
            "launch_flags": list(settings.launch_flags),
            "launch_command": settings.launch_command,
            "slurm_command": settings.slurm_command,
            "sp_size_note": settings.sp_size_note,
            "plan_command": settings.plan_command,
        }
    if found.lowest is not None:
        out["lowest_peak_gib"] = found.lowest.plan.peak_gib
    return out

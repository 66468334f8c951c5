"""Issue 19's one-H200 ladder: 1.2M, 1.6M and 2M tokens of Llama-3.1-8B's shape with every memory flag
(`tiled_layer` included), and tokens/s at 64K and 256K, as one command within a 10-minute budget.

    python -m benchmarks.gpu_ladder                  # one GPU (`bash scripts/gpu_check.sh ladder`)
    python -m benchmarks.gpu_ladder --cpu-dry-run    # the same flow at tiny sizes on CPU (tested)

Each run is one `benchmarks.worker` job (`benchmarks._harness.job`, as `benchmarks/gpu_memory.py` runs them): the
stock Trainer, ZeRO-3 with parameters and optimizer offloaded, gradient checkpointing, tiled loss, offloaded
activations and tiled_layer (which subsumes the tiled MLP), SGD (no optimizer state on the host, as
gpu_memory.py), bf16, flash-attn 2.

Depth: the offloaded layer inputs take `layers x S x hidden x 2` bytes of pinned host RAM (16 GiB per layer at 2M,
and torch's pinned allocator rounds each one up to a power of two), next to the offloaded model states. A test box
may have 128 GiB, so the ladder runs the deepest model whose host RAM, as the planner counts it (AdamW states:
an upper bound for SGD) with rounded checkpoints, fits `--host-memory` less `HOST_RESERVE_GIB` at the top rung.
Scaling to 32 layers: the measured GPU peak plus the planner's 32-layer peak minus its peak at the depth run. With
offloaded activations only two layer inputs stay on the GPU and ZeRO-3 gathers at most 1e9 parameters, so from
2 layers and 1e9 parameters on the difference is the depth-dependent terms alone (0 GiB here; printed per rung).

Rungs pack documents of `--doc-len` tokens (default 64K) into the row: attention then costs O(S x doc) instead of
O(S^2) (a 2M-token causal step is ~6 minutes of attention per layer), while its memory, flash's O(S), is the same.
PASS: the step ran with every flag on and the scaled peak (`max_memory_allocated`) fits the device less the
profile's runtime term; FAIL otherwise, including a rung not run (flags `ParallelismConfig`
refuses together, an earlier rung failed, the budget spent). There is no SKIP. Results: benchmarks/results/.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import _results
from benchmarks.gpu_memory import TINY

K = 1024
RUNGS = (1_200_000, 1_600_000, 2_000_000)
THROUGHPUT = (64 * K, 256 * K)
FULL_LAYERS = 32
HOST_RESERVE_GIB = 24.0  # the processes themselves: torch, CUDA, DeepSpeed's buffers, the dataset rows
# Every memory flag; tiled_layer subsumes tiled_mlp (the planner models it so), so the MLP flag is not set twice.
FLAGS = {"tiled_loss": True, "offload_activations": True, "tiled_layer": True}
# --cpu-dry-run: the flow at tiny sizes; the tiny model runs at 2 layers and is scaled to 4.
DRY = {"rungs": (2048, 3072, 4096), "throughput": (512, 1024), "layers": 2, "full_layers": 4, "doc_len": 1024}


H200_BF16_FLOPS = 989e12  # dense BF16 tensor-core peak, NVIDIA H200 datasheet


def model_flops(model: dict[str, Any], seq_len: int, doc_len: int) -> float:
    """Model FLOPs of one training step on one row (forward + backward = 3 x forward; recompute not counted):
    6 x matmul parameters x tokens (q, k, v, o, MLP, LM head; not the embedding lookup) plus attention,
    12 x layers x heads x head_dim x causal pairs (QK^T and PV, forward and backward), per document of a packed row."""
    h, d, layers = model["hidden"], model["head_dim"], model["layers"]
    per_layer = h * d * (2 * model["heads"] + 2 * model["kv_heads"]) + 3 * h * model["intermediate"]
    dense = 6 * (layers * per_layer + h * model["vocab"]) * seq_len
    doc = doc_len or seq_len
    pairs = (seq_len // doc) * doc * (doc + 1) // 2 + (seq_len % doc) * (seq_len % doc + 1) // 2
    return dense + 12 * layers * model["heads"] * d * pairs


def model_spec(cpu: bool, layers: int) -> dict[str, Any]:
    """The worker's model: the tiny one (dry run) or Llama-3.1-8B's shipped shape, at `layers` layers."""
    from benchmarks.worker import shipped_shape

    return {**(TINY if cpu else shipped_shape("llama3.1-8b", "llama")), "layers": layers}


def plan(spec: dict[str, Any], seq_len: int, flags: dict[str, Any], device: Any) -> Any:
    """The planner's estimate of a ladder run (the worker's model, engine and flags)."""
    from hf_longctx.planner import RunConfig, estimate
    from hf_longctx.planner.model_shape import ModelShape

    fields = {f.name for f in dataclasses.fields(ModelShape)}
    shape = ModelShape(name="ladder", **{k: v for k, v in spec.items() if k in fields})
    run = RunConfig(seq_len=seq_len, engine="zero3", offload_optimizer=True, offload_params=True,
                    gradient_checkpointing=True, attn="flash" if not device.host_is_device else "sdpa",
                    dtype="fp32" if device.host_is_device else "bf16", **flags)  # fmt: skip
    return estimate(shape, run, device)


def host_gib(spec: dict[str, Any], seq_len: int, flags: dict[str, Any], device: Any) -> float:
    """Host RAM of a run: the planner's offloaded states plus each layer's pinned input rounded up to 2^k bytes."""
    from hf_longctx.planner import GIB

    checkpoint = seq_len * spec["hidden"] * 2
    pinned = spec["layers"] * (1 << (checkpoint - 1).bit_length()) / GIB
    return plan(spec, seq_len, flags, device).host_gib - spec["layers"] * checkpoint / GIB + pinned


def choose_layers(cpu: bool, seq_len: int, host_memory: float, flags: dict[str, Any], device: Any) -> int:
    """The most layers (<= 32, >= 2) whose host RAM at `seq_len` fits `host_memory - HOST_RESERVE_GIB`."""
    fits = [n for n in range(2, FULL_LAYERS + 1) if host_gib(model_spec(cpu, n), seq_len, flags, device)
            <= host_memory - HOST_RESERVE_GIB]  # fmt: skip
    return max(fits, default=2)


def worker_spec(args: argparse.Namespace, seq_len: int, steps: int, doc_len: int, flags: dict[str, Any]) -> dict:
    """One Trainer run of the ladder: `steps` optimizer steps, every flag, ZeRO-3 offload."""
    import importlib.util

    cpu = args.cpu_dry_run
    attn = "sdpa" if cpu else ("flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa")
    spec = {"impl": "hf_longctx", "engine": "zero3_offload", "sp": 1, "sp_options": flags, "seq_len": seq_len,
            "steps": steps, "optim": "sgd", "lr": 1e-5, "log": True, "device": "cpu" if cpu else "cuda",
            "dtype": "fp32" if cpu else "bf16", "attn": attn, "gradient_checkpointing": True,
            "model": {**model_spec(cpu, args.layers), "max_positions": max(seq_len, 8192)}}  # fmt: skip
    if doc_len:
        spec.update(data="packed", doc_len=doc_len)
    return spec


def run_one(args: argparse.Namespace, kind: str, seq_len: int, flags: dict[str, Any], ctx: dict[str, Any]) -> dict:
    """Run one rung (ladder: one step, packed; throughput: a warm-up + `--throughput-steps`, one document) and
    judge it; a rung whose budget is spent is a FAIL, not run."""
    from benchmarks import _harness

    record: dict[str, Any] = {"kind": kind, "seq_len": seq_len, "layers": args.layers}
    left = ctx["deadline"] - time.monotonic()
    if ctx.get("stop"):
        return {**record, "status": "not run", "verdict": "FAIL", "why": ctx["stop"]}
    if left < 20:
        return {**record, "status": "not run", "verdict": "FAIL", "why": "the time budget is spent"}
    steps, doc_len = (1, args.doc_len) if kind == "ladder" else (1 + args.throughput_steps, 0)
    spec = worker_spec(args, seq_len, steps, doc_len, flags)
    env = {} if args.cpu_dry_run else {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    env.update(_harness.CPU_ENV if args.cpu_dry_run else {})
    job = _harness.job("benchmarks.worker:run", 1, left, ctx["out_dir"], f"{kind}_s{seq_len}", env=env, spec=spec)
    record.update(status=job["status"], wall_s=round(job["wall_s"], 1), error=job.get("error"))
    if job["status"] != "ok":
        return {**record, "verdict": "FAIL", "why": job["status"]}
    rank = job["result"]["ranks"][0]
    peak = (rank["run_peak_bytes"] if args.cpu_dry_run else rank["process_peak_bytes"]) / 2**30
    planned = plan(dict(spec["model"], layers=args.full_layers), seq_len, flags, ctx["device"]).peak_gib
    scale = planned - plan(spec["model"], seq_len, flags, ctx["device"]).peak_gib
    step_s = [s["step_s"] for s in rank["steps"]]
    record.update(measured_gib=round(peak, 3), scaled_gib=round(peak + scale, 3), depth_terms_gib=round(scale, 3),
                  planned_gib=planned, step_s=step_s, host_peak_gib=round(rank["host_peak_bytes"] / 2**30, 2),
                  flags_active=rank["flags_active"])  # fmt: skip
    if kind == "throughput" and len(step_s) > 1:
        step = statistics.median(step_s[1:])
        record["tokens_per_s"] = round(seq_len / step, 1)
        record["mfu"] = round(model_flops(spec["model"], seq_len, doc_len) / step / H200_BF16_FLOPS, 4)
    inactive = [k for k, on in rank["flags_active"].items() if not on]
    if inactive:
        return {**record, "verdict": "FAIL", "why": f"flags not applied: {inactive}"}
    # max_memory_allocated leaves out the CUDA context, NCCL and cuBLAS workspaces: the profile's runtime term.
    limit = ctx["device"].capacity_gib - ctx["device"].runtime_gib
    if record["scaled_gib"] > limit:
        return {**record, "verdict": "FAIL", "why": f"scaled peak over {limit:.1f} GiB"}
    return {**record, "verdict": "PASS", "why": ""}


COLUMNS: list[_results.Column] = [
    ("run", lambda r: r["kind"]), ("S", lambda r: f"{r['seq_len']:,}"), ("layers", lambda r: str(r["layers"])),
    ("verdict", lambda r: r["verdict"] + (f" ({r['why']})" if r["why"] else "")),
    ("measured GiB", lambda r: _results.fmt(r.get("measured_gib"))),
    ("scaled to full depth GiB", lambda r: _results.fmt(r.get("scaled_gib"))),
    ("planned GiB", lambda r: _results.fmt(r.get("planned_gib"))),
    ("host peak GiB", lambda r: _results.fmt(r.get("host_peak_gib"))),
    ("step s", lambda r: _results.fmt(r["step_s"][-1], ".1f") if r.get("step_s") else "-"),
    ("tokens/s", lambda r: _results.fmt(r.get("tokens_per_s"), ".0f")),
    ("MFU", lambda r: _results.fmt(100 * r["mfu"], ".1f") + "%" if r.get("mfu") is not None else "-"),
]  # fmt: skip


def config_refusal(flags: dict[str, Any]) -> str | None:
    """`ParallelismConfig`'s refusal of the flags (e.g. a pair that does not combine), or None:
    refused, every rung fails unrun with its message rather than as a crashed job."""
    import hf_longctx

    try:
        hf_longctx.ParallelismConfig(sp_size=1, **flags)
    except ValueError as exc:
        return f"ParallelismConfig refuses {sorted(flags)}: {exc}"
    return None


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU (the flow, not the numbers)")
    parser.add_argument("--rungs", help="comma-separated ladder lengths (default 1.2M,1.6M,2M)")
    parser.add_argument("--throughput-lengths", help="comma-separated lengths for tokens/s (default 64K,256K)")
    parser.add_argument("--throughput-steps", type=int, default=1, help="measured steps after one warm-up")
    parser.add_argument("--layers", type=int, help="model depth to run (default: the most the host RAM holds)")
    parser.add_argument("--full-layers", type=int, help="depth the peak is scaled to (default 32)")
    parser.add_argument("--doc-len", type=int, help="packed document length of the ladder rungs (0: one document)")
    parser.add_argument("--host-memory", type=float, default=128.0, help="host RAM in GiB (default 128)")
    parser.add_argument("--budget-s", type=float, default=570.0, help="wall-clock budget of the whole ladder")
    parser.add_argument("--out-prefix", default=None)
    parser.add_argument("--log-dir", type=Path, help="where each job writes its log as it goes (default: a temp dir)")
    args = parser.parse_args(argv)
    dry = DRY if args.cpu_dry_run else {"rungs": RUNGS, "throughput": THROUGHPUT, "full_layers": FULL_LAYERS,
                                        "doc_len": 64 * K}  # fmt: skip
    args.rungs = [int(x) for x in args.rungs.split(",")] if args.rungs else list(dry["rungs"])
    lengths = args.throughput_lengths
    args.throughput_lengths = [int(x) for x in lengths.split(",")] if lengths else list(dry["throughput"])
    args.full_layers = args.full_layers or dry["full_layers"]
    args.doc_len = dry["doc_len"] if args.doc_len is None else args.doc_len
    args.layers = args.layers or dry.get("layers")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the ladder; exit 0 only when every rung PASSes."""
    import torch

    from hf_longctx.planner import DEVICES

    args = parse(argv)
    start = time.monotonic()
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("gpu_ladder: FAIL: no CUDA device (use --cpu-dry-run for the flow on CPU)")
        return 1
    flags = dict(FLAGS)
    stop = config_refusal(flags)
    if args.cpu_dry_run:
        device = dataclasses.replace(DEVICES["cpu"], capacity_gib=1e9)
    else:
        device = DEVICES["h200"].with_capacity(torch.cuda.get_device_properties(0).total_memory / 2**30)
    args.layers = args.layers or choose_layers(args.cpu_dry_run, max(args.rungs), args.host_memory, flags, device)
    ctx = {"deadline": start + args.budget_s, "device": device, "stop": stop,
           "out_dir": args.log_dir or Path(tempfile.mkdtemp(prefix="hf_longctx_gpu_ladder_"))}  # fmt: skip
    ctx["out_dir"].mkdir(parents=True, exist_ok=True)
    print(f"gpu_ladder: {args.layers} layers (scaled to {args.full_layers}), flags {sorted(flags)}, rungs "
          f"{args.rungs}, documents of {args.doc_len or 'S'} tokens, budget {args.budget_s:.0f} s")  # fmt: skip
    records = []
    for kind, lengths in (("ladder", args.rungs), ("throughput", args.throughput_lengths)):
        for seq_len in lengths:
            record = run_one(args, kind, seq_len, flags, ctx)
            records.append(record)
            print(f"{record['verdict']} {kind} S={seq_len:,}: {record['why'] or 'ok'} "
                  f"(scaled peak {record.get('scaled_gib')} GiB, {record.get('wall_s', 0)} s)", flush=True)  # fmt: skip
            if kind == "ladder" and record["verdict"] != "PASS":
                ctx["stop"] = ctx["stop"] or f"an earlier rung failed (S={seq_len:,})"
        ctx["stop"] = stop  # after a failed rung the throughput runs still go (not without tiled_layer)
    passed = all(r["verdict"] == "PASS" for r in records)
    head = f"# GPU ladder (issue 19){' - CPU dry run' if args.cpu_dry_run else ''}: flags {sorted(flags)}"
    tail = f"{sum(r['verdict'] == 'PASS' for r in records)} of {len(records)} PASS: {'PASS' if passed else 'FAIL'}."
    md = "\n".join([head, "", *_results.table(COLUMNS, records), "", tail]) + "\n"
    stamp = datetime.date.today().isoformat() + ("-cpu-dry-run" if args.cpu_dry_run else "")
    prefix = args.out_prefix or _results.RESULTS / f"{stamp}-gpu-ladder"
    _results.write(prefix, {"passed": passed, "args": vars(args), "flags": flags, "records": records}, md)
    print(f"gpu_ladder: {tail}")
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())

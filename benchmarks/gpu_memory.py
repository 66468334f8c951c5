"""GPU check of the memory flags: a Llama-3.1-8B-shaped random-init bf16 model on ONE GPU, with all three
flags and DeepSpeed ZeRO-3 offload (parameters and optimizer in host memory), through the stock Trainer.

    python -m benchmarks.gpu_memory                      # ladder 64K..2M (stops at the first failure) + tokens/s at 64K
    python -m benchmarks.gpu_memory --shape tiny         # the same code path on a tiny model (CPU smoke run)

Method, output (`<date>-gpu-memory.{json,md}`, or `--out` / `--out-prefix`) and the ALST mark: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import _harness, _results

K = 1024
TINY = {"arch": "llama", "vocab": 1024, "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2,
        "head_dim": 16}  # fmt: skip
SHAPES = ("llama-8b", "tiny")  # llama-8b: Llama-3.1-8B's shipped config (32 layers, hidden 4096, 32/8 heads of 128)
FLAGS = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
NO_CUDA = "no CUDA device: skipping the GPU memory benchmark (benchmarks/gpu_memory.py)"


def worker_spec(args: argparse.Namespace, seq_len: int, steps: int, cuda: bool) -> dict[str, Any]:
    """One Trainer run at `seq_len`: `steps` optimizer steps, every flag, ZeRO-3 offload, bf16 on CUDA."""
    from benchmarks.worker import shipped_shape

    model = TINY if args.shape == "tiny" else shipped_shape("llama3.1-8b", "llama")
    attn = args.attn or ("flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa")
    return {"impl": "hf_longctx", "engine": "zero3_offload", "sp": 1, "sp_options": FLAGS, "seq_len": seq_len,
            "steps": steps, "optim": args.optim, "lr": 1e-5, "log": True, "device": "cuda" if cuda else "cpu",
            "dtype": "bf16" if cuda else "fp32", "attn": attn,
            "model": {**model, "max_positions": max(seq_len, 8192)}}  # fmt: skip


def launch(args: argparse.Namespace, seq_len: int, steps: int, out_dir: Path, cuda: bool) -> dict[str, Any]:
    env = {"PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    spec = worker_spec(args, seq_len, steps, cuda)
    record = _harness.job("benchmarks.worker:run", 1, args.timeout, out_dir, f"s{seq_len}_n{steps}", env=env, spec=spec)
    record = {"seq_len": seq_len, "steps_requested": steps, **record}
    if record["status"] == "ok":
        rank = record.pop("result")["ranks"][0]
        if not all(rank["flags_active"].values()) or len(rank["flags_active"]) < len(FLAGS):
            record.update(status="failed", error=f"memory flags not applied: {rank['flags_active']}")
        gpu_peak = rank["process_peak_bytes"] if cuda else None
        record.update(rank, steps=[s["step_s"] for s in rank["steps"]], gpu_peak_bytes=gpu_peak)
    return record


COLUMNS: list[_results.Column] = [
    ("S", lambda r: str(r["seq_len"])), ("run", lambda r: r["kind"]), ("status", lambda r: r["status"]),
    ("step s", lambda r: f"{r['steps'][-1]:.1f}" if r.get("steps") else "-"),
    ("GPU peak GiB", lambda r: _results.fmt(r.get("gpu_peak_bytes"), ".1f", _results.GiB)),
    ("host peak GiB", lambda r: _results.fmt(r.get("host_peak_bytes"), ".1f", _results.GiB)),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "gpu-memory", timeout=1200)
    parser.add_argument("--out-prefix", dest="out", help="the same as --out")
    parser.add_argument("--shape", choices=SHAPES, default="llama-8b")
    parser.add_argument("--lengths", default=",".join(str(n * K) for n in (64, 128, 256, 512, 768, 1024, 1536, 2048)))
    parser.add_argument("--throughput-length", type=int, default=64 * K)
    parser.add_argument("--throughput-steps", type=int, default=3)
    parser.add_argument("--optim", default="sgd")
    parser.add_argument("--attn", default=None, help="default: flash_attention_2 when installed, else sdpa")
    args = parser.parse_args(argv)

    import torch

    cuda = torch.cuda.is_available()
    if args.shape != "tiny" and not cuda:
        print(NO_CUDA)
        return 0
    out_dir = Path(tempfile.mkdtemp(prefix="hf_longctx_gpu_memory_"))
    throughput = launch(args, args.throughput_length, 1 + args.throughput_steps, out_dir, cuda)
    records = [dict(throughput, kind="throughput")]
    for seq_len in (int(x) for x in args.lengths.split(",")):
        records.append(dict(launch(args, seq_len, 1, out_dir, cuda), kind="ladder"))
        print(f"S={seq_len}: {records[-1]['status']} ({records[-1]['wall_s']:.0f} s)", flush=True)
        if records[-1]["status"] != "ok":
            break
    longest = max([r["seq_len"] for r in records if r["kind"] == "ladder" and r["status"] == "ok"], default=None)
    tokens_per_s = None
    if throughput["status"] == "ok" and len(throughput["steps"]) > 1:
        tokens_per_s = args.throughput_length / statistics.median(throughput["steps"][1:])
    title = f"GPU memory ladder: {args.shape} shape, one GPU, flags {sorted(FLAGS)}, ZeRO-3 offload, optim {args.optim}"
    tail = [f"Longest sequence for one optimizer step: {longest} tokens (ALST on one H200: 1.2M).",
            f"Tokens/s at {args.throughput_length}: {tokens_per_s and round(tokens_per_s, 1)}."]  # fmt: skip
    data = {"longest": longest, "tokens_per_s": tokens_per_s, "args": vars(args), "records": records}
    _results.write(_harness.out(args), data, _results.page(title, None, _results.table(COLUMNS, records), tail))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

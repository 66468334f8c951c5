"""A/B benchmark entry point: hf_longctx Ulysses vs the upstream accelerate/DeepSpeed SP path.

    python -m benchmarks.run                   # CPU profile (gloo, tiny Llama), about 10-15 min on 2 cores
    python -m benchmarks.run --quick           # smoke grid: SP=2, S=1024, 1 repeat (about a minute)
    python -m benchmarks.run --profile gpu     # NCCL, bf16, flash_attention_2, Qwen3-4B / Llama-8B shapes
    python -m benchmarks.run --quick --out /tmp/ab   # results to /tmp/ab.{json,md} and /tmp/ab-*.png

`PROFILES` are the grids, `plan` their jobs in A B / B A order; method and outputs: benchmarks/README.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import _harness, _results, report
from benchmarks.worker import shipped_shape

# Tiny random-init Llama for CPU: 4 query / 4 key-value heads (both divide SP = 2 and 4, so the theory
# formula applies without KV replication), head_dim 32, 2 layers. Small enough that the whole CPU grid,
# including S = 16K, fits the 15-minute budget on 2 cores (see benchmarks/README.md).
CPU_MODEL = {"name": "tiny-llama", "arch": "llama", "vocab": 2048, "hidden": 128, "intermediate": 256, "layers": 2,
             "heads": 4, "kv_heads": 4, "head_dim": 32}  # fmt: skip
# Qwen3-4B and Llama-3.1-8B shapes, from the configs hf_longctx ships for the planner.
GPU_MODELS = {"qwen3-4b-shape": ("qwen3-4b", "qwen3"), "llama-8b-shape": ("llama3.1-8b", "llama")}

K = 1024
_CPU = {"device": "cpu", "dtype": "fp32", "attn": "sdpa", "models": {"tiny-llama": CPU_MODEL}, "warmup": 1,
        "sp1_repeats": 1, "gradient_checkpointing": False}  # fmt: skip
PROFILES: dict[str, dict[str, Any]] = {
    # (SP, S) cells; S = 16K only for SP = 4 (SP = 2 at 16K alone would take ~4 of the 15 minutes).
    "cpu": {**_CPU, "cells": [(2, s) for s in (2 * K, 4 * K, 8 * K)] + [(4, s) for s in (2 * K, 4 * K, 8 * K, 16 * K)],
            "sp1_seq_lens": [2 * K, 4 * K, 8 * K, 16 * K], "steps": 3, "repeats": 2, "timeout": 600},
    "cpu-quick": {**_CPU, "cells": [(2, K)], "sp1_seq_lens": [K], "steps": 2, "repeats": 1, "timeout": 300},
    # SP = number of visible GPUs, S = 32K..256K (cells filled in at run time); SP=1 holds the whole model and
    # optimizer on one GPU: only the shortest length is attempted.
    "gpu": {"device": "cuda", "dtype": "bf16", "attn": "flash_attention_2", "models": GPU_MODELS, "cells": None,
            "seq_lens": [32 * K, 64 * K, 128 * K, 256 * K], "sp1_seq_lens": [32 * K], "warmup": 1, "steps": 3,
            "repeats": 2, "sp1_repeats": 1, "timeout": 900, "gradient_checkpointing": True},
}  # fmt: skip


def model_shape(profile: dict[str, Any], name: str) -> dict[str, Any]:
    """A profile's model as a worker spec (a shipped config's shape is given as `(config name, arch)`)."""
    model = profile["models"][name]
    return shipped_shape(*model) if isinstance(model, (tuple, list)) else model


def make_spec(profile: dict[str, Any], model_name: str, impl: str, sp: int, seq_len: int) -> dict[str, Any]:
    """The JSON spec one worker job runs (see `benchmarks.worker`)."""
    model = dict(model_shape(profile, model_name), name=model_name, max_positions=seq_len)
    cpu = profile["device"] == "cpu"
    # CPU: one thread per process. Intra-op threads on a shared 2-core box made the single process ~3x slower than
    # one thread (OpenMP barriers spinning against other work), so SP=1 is one core and SP=P is P single-threaded
    # processes (SP=4 oversubscribes 2 cores 2x, identically for A and B). `op_profile`: one extra torch.profiler
    # step per SP run for the "where the time goes" table (CPU only). `steps` counts the warm-up ones.
    return {"impl": impl, "sp": 1 if impl == report.BASELINE else sp, "seq_len": seq_len, "warmup": profile["warmup"],
            "steps": profile["warmup"] + profile["steps"], "seed": 0, "threads": 1 if cpu else None,
            "op_profile": cpu and impl != report.BASELINE, "model": model,
            **{k: profile[k] for k in ("device", "dtype", "attn", "gradient_checkpointing")}}  # fmt: skip


def plan(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """All worker specs in execution order: per S, the SP=1 baseline(s), then each SP cell's A/B pairs.

    The order of the pair flips after every pair (A B, B A, A B, ...), so each cell with an even number of
    repeats is balanced and linear drift cancels.
    """
    specs, flip = [], False
    for model_name in profile["models"]:
        for seq_len in sorted({s for _, s in profile["cells"]} | set(profile["sp1_seq_lens"])):
            n_sp1 = profile["sp1_repeats"] if seq_len in profile["sp1_seq_lens"] else 0
            specs += [make_spec(profile, model_name, report.BASELINE, 1, seq_len) for _ in range(n_sp1)]
            for sp in (sp for sp, s in profile["cells"] if s == seq_len):
                for rep in range(profile["repeats"]):
                    order, flip = report.IMPLS[::-1] if flip else report.IMPLS, not flip
                    specs += [dict(make_spec(profile, model_name, impl, sp, seq_len), rep=rep) for impl in order]
    return specs


def nproc(spec: dict[str, Any]) -> int:
    return 1 if spec["impl"] == report.BASELINE else spec["sp"]


def launch(session: _harness.Session, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one worker job and check it: `{"spec", "status", "wall_s", "result"?, "summary"?, "error"?}`."""
    env = {"OMP_NUM_THREADS": str(spec["threads"]), **_harness.MALLOC_ENV} if spec["device"] == "cpu" else {}
    worker_spec = {k: v for k, v in spec.items() if k not in ("rep", "label")}
    label = f"{spec['model']['name']} {spec.get('label', spec['impl']):>14} SP={spec['sp']} S={spec['seq_len']:>6}"
    record = session.run(spec, label, "benchmarks.worker:run", nproc(spec), timeout, env=env, spec=worker_spec)
    if record["status"] == "ok":
        try:
            record["summary"] = report.run_summary(record["result"], spec["warmup"])
            _check_sp_active(spec, record["result"], record["summary"])
        except (KeyError, ValueError) as e:
            record["status"], record["error"] = "failed", f"bad result: {e}"
    return record


def _check_sp_active(spec: dict[str, Any], result: dict[str, Any], summary: dict[str, Any]) -> None:
    """Each rank must have seen S / SP tokens, and SP runs must have exchanged data (else SP was not on)."""
    local = {r["local_seq_len"] for r in result["ranks"]}
    if local != {spec["seq_len"] // spec["sp"]}:
        raise ValueError(f"ranks saw {sorted(local)} tokens per forward, expected {spec['seq_len'] // spec['sp']}")
    # ring backends (benchmarks.backends) exchange by point-to-point / all-gather, counted by hf_longctx
    ring = any(op.startswith("ring_") for r in result["ranks"] for s in r["steps"] for op in s.get("hf_ops", {}))
    if (spec["sp"] > 1) != (summary["a2a_calls"] > 0 or ring):
        raise ValueError(f"{summary['a2a_calls']} all_to_all calls per step with sp={spec['sp']}")


def _describe(model: dict[str, Any]) -> str:
    return (
        f"({model['arch']}, {model['layers']} layers, hidden {model['hidden']}, {model['heads']}/{model['kv_heads']} "
        f"heads x {model['head_dim']}, intermediate {model['intermediate']}, vocab {model['vocab']}, random init)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "<profile>", timeout=None, repeats=None, steps=None)
    parser.add_argument("--profile", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="smoke grid: SP=2, S=1024, 1 repeat (CPU)")
    parser.add_argument("--warmup", type=int, help="warm-up steps skipped per run (default: profile's)")
    parser.add_argument("--nproc", type=int, help="GPU profile: SP size (default: visible GPUs)")
    parser.add_argument("--seq-lens", type=str, help="comma-separated S for every SP size (overrides the grid)")
    parser.add_argument("--models", type=str, help="GPU profile: comma-separated subset of the model shapes")
    parser.add_argument("--attn", type=str, help="attention kernel (default: sdpa on CPU, flash_attention_2 on GPU)")
    parser.add_argument("--dry-run", action="store_true", help="print the planned jobs and exit")
    parser.add_argument("--from-json", type=Path, help="re-render the table and plots of an earlier result JSON")
    args = parser.parse_args(argv)
    if args.from_json:  # the runs are kept in the JSON: aggregate them again with the current code
        data = json.loads(args.from_json.read_text())
        write_outputs(args.out or str(args.from_json.with_suffix("")), data["meta"], data["runs"])
        return 0

    args.name = "cpu-quick" if args.quick else args.profile
    profile = json.loads(json.dumps(PROFILES[args.name]))  # a copy
    profile["cells"] = [tuple(c) for c in profile["cells"]] if profile["cells"] else None
    profile.update(
        {k: getattr(args, k) for k in ("repeats", "steps", "warmup", "timeout", "attn") if getattr(args, k) is not None}
    )
    if profile["device"] == "cuda":
        if args.nproc is None:
            import torch

            args.nproc = torch.cuda.device_count()
        if args.nproc < 2:
            print(f"note: {args.nproc} visible GPU(s): only SP=1 baselines can run", file=sys.stderr)
        profile["cells"] = [(args.nproc, s) for s in profile["seq_lens"]] if args.nproc >= 2 else []
        if args.models:
            profile["models"] = {m: profile["models"][m] for m in args.models.split(",")}
    if args.seq_lens:
        lens = [int(s) for s in args.seq_lens.split(",")]
        profile["cells"] = [(sp, s) for sp in sorted({sp for sp, _ in profile["cells"]}) for s in lens]
        profile["sp1_seq_lens"] = lens

    specs = plan(profile)
    if args.dry_run:
        for spec in specs:
            print(f"torchrun --standalone --nproc_per_node {nproc(spec)} -m benchmarks._harness --call "
                  f"benchmarks.worker:run --kwargs '{json.dumps({'spec': spec})}' --out FILE")  # fmt: skip
        print(f"{len(specs)} jobs", file=sys.stderr)
        return 0
    session = _harness.Session("run", argv)
    runs = [launch(session, spec, profile["timeout"]) for spec in specs]
    meta = session.finish()
    ok = [r for r in runs if r["status"] == "ok"]
    meta.update(profile=args.name, versions=ok[0]["result"].get("versions", {}) if ok else {}, zero_stage=1)
    meta.update({k: profile[k] for k in ("warmup", "steps", "repeats", "device", "dtype", "attn", "cells")})
    meta["models"] = {m: _describe(model_shape(profile, m)) for m in profile["models"]}
    write_outputs(_harness.out(args), meta, runs)
    return 0 if ok and len(ok) == len(runs) else 1


def write_outputs(prefix: str, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Aggregate `runs` and write `<prefix>.json`, `<prefix>.md` and the PNGs."""
    rows, base = report.cell_rows(runs), report.baseline_rows(runs)
    meta["headline"] = report.headline(rows)
    plots = report.plot(rows, base, prefix) if rows or base else []
    meta["plots"] = [Path(p).name for p in plots]
    data = {"meta": meta, "cells": rows, "baselines": base, "runs": runs}
    _results.write(prefix, data, report.render_markdown(meta, rows, base), plots)


if __name__ == "__main__":
    sys.exit(main())

"""DPO under SP on CPU: per-rank peak memory and step time at SP=2 with `tiled_loss` vs one process without SP.

    python -m benchmarks.dpo_memory                     # S = 1K and 2K, 2 repeats (no SP needs ~8 GiB at 2K)
    python -m benchmarks.dpo_memory --seq-lens 1024 --repeats 1 --out /tmp/dpo   # a quick look

`VARIANTS` and `spec` are the runs (`benchmarks.worker.run` with `trainer="dpo"`); the method: benchmarks/README.md
("DPO"). Writes `benchmarks/results/<date>-dpo-memory.{json,md}`.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import _harness, _results

TARGET = 0.6  # issue 17: the per-rank peak at SP=2 with tiled_loss <= 0.6 x the run without SP
MODEL = {"arch": "llama", "vocab": 32768, "hidden": 256, "intermediate": 512, "layers": 2, "heads": 8, "kv_heads": 2,
         "head_dim": 32}  # fmt: skip
VARIANTS = {"no SP": ("none", 1, {}), "no SP + tiled_loss": ("hf_longctx", 1, {"tiled_loss": True}),
            "SP=2 + tiled_loss": ("hf_longctx", 2, {"tiled_loss": True})}  # fmt: skip


def spec(variant: str, seq_len: int, steps: int) -> dict[str, Any]:
    impl, sp, options = VARIANTS[variant]
    return {"impl": impl, "sp": sp, "sp_options": options, "engine": "ddp", "trainer": "dpo", "seq_len": seq_len,
            "warmup": 1, "steps": 1 + steps, "optim": "sgd", "lr": 1e-3, "log": True, "threads": 1, "dtype": "fp32",
            "attn": "sdpa", "model": {**MODEL, "max_positions": 2 * seq_len}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "dpo-memory", timeout=1200, repeats=2, steps=2)
    parser.add_argument("--seq-lens", default="1024,2048")
    args = parser.parse_args(argv)

    def launch(seq_len: int, variant: str) -> dict[str, Any]:
        job = spec(variant, seq_len, args.steps)
        return {"target": "benchmarks.worker:run", "nproc": job["sp"], "env": _harness.CPU_ENV, "spec": job}

    def numbers(record: dict[str, Any]) -> dict[str, Any]:
        ranks = record["result"]["ranks"]
        if record["spec"]["variant"] != "no SP" and not all(r["flags_active"].get("tiled_loss") for r in ranks):
            raise SystemExit(f"tiled_loss was not applied: {[r['flags_active'] for r in ranks]}")
        step_s = _harness.slowest_rank_median(ranks, "step_s", 1)
        return {"peak": _harness.worst(record, "run_peak_bytes"), "step_s": step_s}

    columns: list[_results.Column] = [
        _results.col("peak GiB per rank", "peak", ".3f", _results.GiB), _results.col("x no SP", "x_peak", ".3f"),
        ("target", lambda r: _results.target(r["x_peak"], TARGET) if r["variant"] == "SP=2 + tiled_loss" else ""),
        _results.col("step s", "step_s"), _results.col("x no SP", "x_step_s", ".3f"),
    ]  # fmt: skip
    return _harness.compare(
        args, argv, [int(s) for s in args.seq_lens.split(",")], list(VARIANTS), launch, numbers, columns,
        "DPO memory per rank: SP=2 + tiled_loss vs no SP, CPU", "Model and method: benchmarks/README.md (\"DPO\").",
        target=("SP=2 + tiled_loss", "x_peak", TARGET),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

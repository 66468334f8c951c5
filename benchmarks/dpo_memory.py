"""DPO under SP on CPU: per-rank peak memory and step time at SP=2 with `tiled_loss` vs one process without SP.

    python -m benchmarks.dpo_memory                     # S = 1K and 2K, 2 repeats (no SP needs ~8 GiB at 2K)
    python -m benchmarks.dpo_memory --seq-lens 1024 --repeats 1    # a quick look

Each run is one `benchmarks._harness` job of `benchmarks.worker.run` with `trainer="dpo"`: TRL's `DPOTrainer`
(sigmoid loss, a reference model of the same initial weights, SGD), DDP on gloo, fp32, sdpa, one thread per rank, on
pairs whose prompt + chosen completion is S tokens (rejected: half the completion), so each step scores 2 rows of
about S tokens with the policy and the reference. The model is a random-init Llama (2 layers, hidden 256, 8 / 2
heads) with a vocabulary of 32,768: at these lengths the logits dominate, which `tiled_loss` removes and SP halves.
Peak: the largest resident growth of any rank from just before the model is built to the end of training
(`run_peak_bytes`: model, reference, optimizer, activations, buffers). Step time: the slowest rank's median over the
measured steps. Runs alternate A B, B A. Writes `benchmarks/results/<date>-dpo-memory.{json,md}`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="1024,2048")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per run (after 1 warm-up)")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=None, help="results prefix (default: results/<date>-dpo-memory)")
    args = parser.parse_args(argv)
    session = _harness.Session("python -m benchmarks.dpo_memory", argv, Path(tempfile.mkdtemp(prefix="bench-dpo-")))
    cells: dict[tuple[int, str], list[dict[str, float]]] = {}
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        for rep in range(args.repeats):
            for variant in list(VARIANTS)[:: 1 if rep % 2 == 0 else -1]:
                job = spec(variant, seq_len, args.steps)
                record = session.run(dict(job, variant=variant), f"{variant:>18} S={seq_len}", "benchmarks.worker:run",
                                     job["sp"], args.timeout, env=_harness.CPU_ENV, spec=job)  # fmt: skip
                if record["status"] != "ok":
                    continue
                ranks = record["result"]["ranks"]
                if variant != "no SP" and not all(r["flags_active"].get("tiled_loss") for r in ranks):
                    raise SystemExit(f"tiled_loss was not applied: {[r['flags_active'] for r in ranks]}")
                peak = max(r["run_peak_bytes"] for r in ranks)
                step = _harness.slowest_rank_median(ranks, "step_s", 1)
                cells.setdefault((seq_len, variant), []).append({"peak": peak, "step_s": step})
    meta = session.finish(lambda r: f"{r['spec']['variant']} S={r['spec']['seq_len']}")
    rows = []
    for seq_len in sorted({s for s, _ in cells}):
        row: dict[str, Any] = {"seq_len": seq_len}
        for variant in VARIANTS:
            runs = cells.get((seq_len, variant), [])
            row[variant] = {k: _harness.median(r[k] for r in runs) for k in ("peak", "step_s")} if runs else {}
        base, sp = row["no SP"], row["SP=2 + tiled_loss"]
        row["peak_ratio"] = _harness.ratio(sp.get("peak"), base.get("peak"))
        row["time_ratio"] = _harness.ratio(sp.get("step_s"), base.get("step_s"))
        rows.append(row)
    columns: list[_results.Column] = [
        ("S", lambda r: _results.seq(r["seq_len"])),
        *[(f"{v} peak GiB", lambda r, v=v: _results.fmt(r[v].get("peak"), ".3f", _results.GiB)) for v in VARIANTS],
        *[(f"{v} step s", lambda r, v=v: _results.fmt(r[v].get("step_s"))) for v in VARIANTS],
        ("peak ratio", lambda r: _results.fmt(r["peak_ratio"], ".3f")),
        ("target", lambda r: f"<= {TARGET}: " + ("reached" if _reached(r) else "NOT reached")),
        ("step time ratio", lambda r: _results.fmt(r["time_ratio"], ".3f")),
    ]
    head = f"# DPO memory per rank: SP=2 + tiled_loss vs no SP, CPU ({meta['date']})"
    md = "\n".join([head, "", _results.run_line(meta), "Model and method: `benchmarks/dpo_memory.py`.", "",
                    *_results.table(columns, rows)]) + "\n"  # fmt: skip
    prefix = args.out or _results.RESULTS / f"{datetime.date.today().isoformat()}-dpo-memory"
    _results.write(prefix, {"meta": meta, "rows": rows, "runs": session.records}, md)
    return 0 if rows and all(map(_reached, rows)) else 1


def _reached(row: dict[str, Any]) -> bool:
    return row["peak_ratio"] is not None and row["peak_ratio"] <= TARGET


if __name__ == "__main__":
    sys.exit(main())

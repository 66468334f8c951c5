"""Peak memory and step time against sequence length for a sliding-window model (issue 38), with the planner beside.

    python -m benchmarks.window_scaling [--seqs 4096,8192,16384,32768,65536] [--sps 1,2] [--repeats 1] [--out P]
    python -m benchmarks.window_scaling --from-json benchmarks/results/<date>-window-scaling.json   # re-render

A random-init Mistral whose every layer has a sliding window of 256 (hidden 256, 8 query / 2 key-value heads of
32, MLP 512, vocabulary 512, 2 layers, float32, sdpa) trains `STEPS` optimizer steps through the stock `Trainer`
(AdamW, DDP on gloo for sp_size 2; `hf_longctx.ParallelismConfig(sp_size=P, sp_backend="ulysses")`, which serves
attention at sp_size 1 too) on one random document of S tokens, in a fresh `benchmarks._harness` job per run (one
thread per rank, glibc's mmap threshold fixed). Measured per run, worst rank:

- peak: the resident growth from just before the model is built to the end of training (`run_peak_bytes`:
  model, AdamW states, activations, runtime buffers), what `hf-longctx plan` predicts;
- step activations: the resident growth within a measured step (`act_bytes`);
- step time: the slowest rank's median over the steps after the first (wall clock), the median and the best over
  repeats (other jobs sharing the machine only ever add time), and the process CPU time per step (which counts only
  the time the process ran: the steadier number then).

Beside them the planner's CPU prediction of the peak, its one runtime term calibrated on the first point (as
`plan_validate` does) and used unchanged for the rest. Verdicts: each doubling of S costs at most 2.2x in peak, in
step activations and in step time (linear, not quadratic), and the planner is within 15% of the measured peak.
Results: `benchmarks/results/<date>-window-scaling.{json,md}` and `-window-scaling.png`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks import _harness as H
from benchmarks import _results as R

STEPS = 3  # the first is warm-up; AdamW's states exist from the second on
WINDOW = 256
MODEL = {"arch": "mistral", "vocab": 512, "hidden": 256, "intermediate": 512, "layers": 2, "heads": 8, "kv_heads": 2,
         "head_dim": 32, "extra": {"sliding_window": WINDOW}}  # fmt: skip
DOUBLING_LIMIT, PLANNER_TOLERANCE = 2.2, 0.15


def spec(seq: int, sp: int) -> dict[str, Any]:
    """The `benchmarks.worker` spec of one point."""
    return {"impl": "hf_longctx", "engine": "ddp", "sp": sp, "sp_options": {"sp_backend": "ulysses"},
            "seq_len": seq, "steps": STEPS, "attn": "sdpa", "dtype": "fp32",
            "model": {**MODEL, "max_positions": seq}}  # fmt: skip


def predict(seq: int, sp: int, runtime_gib: float):
    """The planner's CPU plan of a point (the window model as `ModelShape` reads it from a config)."""
    from hf_longctx.planner import DEVICES, ModelShape, RunConfig, estimate

    config = {"hidden_size": MODEL["hidden"], "num_hidden_layers": MODEL["layers"], "vocab_size": MODEL["vocab"],
              "num_attention_heads": MODEL["heads"], "num_key_value_heads": MODEL["kv_heads"],
              "head_dim": MODEL["head_dim"], "intermediate_size": MODEL["intermediate"], "sliding_window": WINDOW,
              "model_type": "mistral"}  # fmt: skip
    shape = ModelShape.from_config(config, name="window-mistral")
    run = RunConfig(seq_len=seq, world=sp, sp=sp, engine="ddp", dtype="fp32", attn="sdpa")
    device = dataclasses.replace(DEVICES["cpu"], runtime_gib=runtime_gib, capacity_gib=1e9)
    return estimate(shape, run, device)


def row(record: dict[str, Any]) -> dict[str, Any]:
    """The numbers of one ok run."""
    ranks = record["result"]["ranks"]
    return {
        "seq_len": record["spec"]["seq_len"], "sp": record["spec"]["sp"],
        "peak_gib": max(r["run_peak_bytes"] for r in ranks) / R.GiB,
        "step_act_gib": H.slowest_rank_median(ranks, "act_bytes", warmup=1) / R.GiB,
        "step_s": H.slowest_rank_median(ranks, "step_s", warmup=1),
        "cpu_s": H.slowest_rank_median(ranks, "cpu_s", warmup=1),
    }  # fmt: skip


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (sp, S) over repeats, the planner's prediction and error, and each doubling's ratios."""
    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["sp"], r["seq_len"]), []).append(r)
    out = []
    for (sp, seq), runs in sorted(cells.items()):
        medians = {k: H.median(r[k] for r in runs) for k in ("peak_gib", "step_act_gib", "step_s", "cpu_s")}
        # The least disturbed run's wall time: other jobs on the machine only ever add to it.
        out.append({"sp": sp, "seq_len": seq, "runs": len(runs), **medians, "best_s": min(r["step_s"] for r in runs)})
    first = out[0]
    runtime = first["peak_gib"] - predict(first["seq_len"], first["sp"], 0.0).peak_gib
    for i, r in enumerate(out):
        plan = predict(r["seq_len"], r["sp"], runtime)
        r.update(predicted_gib=plan.peak_gib, error=plan.peak_gib / r["peak_gib"] - 1, calibration=i == 0)
        r["peak_phase"], r["kernel"] = plan.peak_phase, plan.attention_kernel
        prev = out[i - 1] if i and out[i - 1]["sp"] == r["sp"] and out[i - 1]["seq_len"] * 2 == r["seq_len"] else None
        for key in ("peak_gib", "step_act_gib", "step_s", "best_s", "cpu_s"):
            r[f"x_{key}"] = H.ratio(r[key], prev[key]) if prev else None
    return [{**r, "runtime_gib": runtime} for r in out]


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per claim, with the worst value measured."""
    lines = []
    claims = (("peak_gib", "peak"), ("step_act_gib", "step activations"), ("step_s", "step time (median)"),
              ("best_s", "step time (best run)"), ("cpu_s", "process CPU time per step (median)"))  # fmt: skip
    for key, what in claims:
        ratios = [r[f"x_{key}"] for r in rows if r[f"x_{key}"] is not None]
        worst = max(ratios, default=None)
        lines.append(f"- each doubling of S, {what}: worst {R.fmt(worst)}x ({R.target(worst, DOUBLING_LIMIT)})")
    errors = [abs(r["error"]) for r in rows if not r["calibration"]]
    worst = max(errors, default=None)
    lines.append(f"- planner vs measured peak: worst {R.fmt(None if worst is None else 100 * worst, '.1f')}% "
                 f"({R.target(worst, PLANNER_TOLERANCE)})")  # fmt: skip
    return lines


COLUMNS: list[R.Column] = [
    ("sp", lambda r: str(r["sp"])), ("S", lambda r: R.seq(r["seq_len"])), ("runs", lambda r: str(r["runs"])),
    R.col("peak GiB", "peak_gib", ".3f"), R.col("x peak", "x_peak_gib"),
    ("planner GiB", lambda r: f"{r['predicted_gib']:.3f}" + (" (calibration)" if r["calibration"] else "")),
    ("planner error", lambda r: f"{100 * r['error']:+.1f}%"),
    R.col("step activations GiB", "step_act_gib", ".3f"), R.col("x act", "x_step_act_gib"),
    R.col("step s", "step_s"), R.col("x time", "x_step_s"), R.col("best step s", "best_s"), R.col("x best", "x_best_s"),
    R.col("CPU s", "cpu_s"), R.col("x CPU", "x_cpu_s"),
]  # fmt: skip


def plot(prefix: str, rows: list[dict[str, Any]]) -> str:
    panels = []
    for key, label in (("peak_gib", "peak per rank (GiB)"), ("step_s", "step time (s)")):
        lines = []
        for sp in sorted({r["sp"] for r in rows}):
            mine = [r for r in rows if r["sp"] == sp]
            lines += R.line(mine, lambda r, k=key: r[k], label=f"measured, sp {sp}")
            if key == "peak_gib":
                lines += R.line(mine, lambda r: r["predicted_gib"], label=f"planner, sp {sp}", linestyle="--")
        panels.append({"title": label, "ylabel": label, "lines": lines, "logx": 2, "logy": True})
    return R.line_plots(f"{prefix}.png", panels)


def report(prefix: str, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """The results page, JSON and plot of a session's records."""
    rows = [row(r) for r in records if r["status"] == "ok"]
    table = summarize(rows) if rows else []
    text = R.page(
        "Sliding-window model: peak memory and step time vs sequence length (issue 38)", meta,
        f"Model: {MODEL} (every layer windowed); {STEPS} optimizer steps per run (1 warm-up), fp32, sdpa, CPU, one "
        "thread per rank. Peak = resident growth from model build to the end of training, worst rank; the planner's "
        "runtime term is calibrated on the first row.",
        R.table(COLUMNS, table), verdicts(table) if table else "no run finished",
        f"Attention kernel (planner): {table[0]['kernel'] if table else 'n/a'}",
    )  # fmt: skip
    plots = [plot(prefix, table)] if table else []
    R.write(prefix, {"meta": meta, "rows": table, "records": records}, text, plots)


def main(argv: list[str] | None = None) -> int:
    parser = H.options(__doc__, "window-scaling", timeout=900, repeats=1)
    parser.add_argument("--seqs", default="4096,8192,16384,32768,65536", help="sequence lengths, doubling")
    parser.add_argument("--sps", default="1,2", help="sp sizes")
    parser.add_argument("--from-json", help="re-render a results JSON's records (no runs)")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(args.from_json.removesuffix(".json"), saved["meta"], saved["records"])
        return 0
    seqs, sps = [int(s) for s in args.seqs.split(",")], [int(s) for s in args.sps.split(",")]
    session = H.Session("window_scaling", argv)
    for rep in range(args.repeats):
        for seq in seqs:
            for sp in sps[:: 1 if rep % 2 == 0 else -1]:
                point = spec(seq, sp)
                session.run(point, f"sp{sp} S={seq}", "benchmarks.worker:run", sp, args.timeout, env=H.CPU_ENV,
                            spec=point)  # fmt: skip
    report(H.out(args), session.finish(), session.records)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A long SP run that must not drift: live objects and tensors, threads, process groups, resident memory, step time.

    python -m benchmarks.drift                  # 300 optimizer steps at SP=2 on 2 CPU processes (~2-4 min here)
    python -m benchmarks.drift --steps 60 --warmup 20 --out /tmp/drift   # a quick look: /tmp/drift.{json,md,png}
    python -m benchmarks.drift --from-json benchmarks/results/<date>-drift.json   # re-render table and plot
    python -m benchmarks.drift --steps 40 --warmup 8 --windows 8 --judge counts   # tests/dist/test_drift.py

`summarize` holds the verdicts; the run and the verdicts are described in benchmarks/README.md ("Drift").
"""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import _harness, _results

RSS_GROWTH_LIMIT = 0.01
CENSUS = ("tensors", "tensor_bytes", "objects")
# Verdicts no other process, allocator or clock can move: what a short run (the test) is judged by.
COUNT_VERDICTS = ("census", "threads", "groups")


def census_growth(after: list[dict[str, Any]], epoch: int) -> dict[str, list[int]] | None:
    """Per census count: [highest in the first window, highest in the last], windows of max(epoch, half) steps.

    A step's counts repeat with the epoch (a new sampler pass holds a few more objects at its boundary), so
    each window spans a whole epoch and its highest count is the epoch's; one object leaked anywhere in the
    last window raises its highest count. None when the samples have no census or too few steps for two epochs.
    """
    window = max(epoch, len(after) // 2)
    if not after or CENSUS[0] not in after[0] or 2 * window > len(after):
        return None
    return {k: [max(s[k] for s in after[:window]), max(s[k] for s in after[-window:])] for k in CENSUS}


def summarize(per_rank: list[list[dict[str, float]]], warmup: int, epoch: int) -> dict[str, Any]:
    """Verdicts and numbers from every rank's samples (see the module docstring); `epoch`: steps per epoch.

    The census (live objects, tensors, tensor bytes after a full collection) is the leak verdict noise cannot
    fake. Resident memory swings from step to step (glibc returns and re-maps the large freed blocks: +-15% on
    the default run), so the first and last windows of up to 50 measured steps are compared by their floor (the
    verdict of the long run: what a leak raises; a 60-step run's floor once rose 3.6% with its slope at -16 MiB
    per 100 steps), their median and their peak.
    """
    out: dict[str, Any] = {"warmup": warmup, "steps": len(per_rank[0]), "epoch": epoch, "ranks": []}
    for samples in per_rank:
        after = samples[warmup:]
        window = max(min(50, len(after) // 2), 1)
        first, last = [s["rss_mib"] for s in after[:window]], [s["rss_mib"] for s in after[-window:]]
        times = [s["step_s"] for s in after]
        half = len(times) // 2
        t_first, t_second = statistics.median(times[:half]), statistics.median(times[half:])
        rss_first, rss_last, step = statistics.median(first), statistics.median(last), [s["step"] for s in after]
        out["ranks"].append({
            "window": window, "rss_first_mib": rss_first, "rss_last_mib": rss_last,
            "rss_growth": rss_last / rss_first - 1, "rss_floor_growth": min(last) / min(first) - 1,
            "rss_peak_growth": max(last) / max(first) - 1,
            "rss_slope_mib_per_100": 100 * _slope(step, [s["rss_mib"] for s in after]),
            "threads": sorted({s["threads"] for s in after}), "groups": sorted({s["groups"] for s in samples}),
            "step_s_first_half": t_first, "step_s_second_half": t_second, "step_time_ratio": t_second / t_first,
            "step_s_slope_per_100": 100 * _slope(step, times), "census": census_growth(after, epoch),
        })  # fmt: skip
    ranks = out["ranks"]
    out["ok"] = {"memory": all(r["rss_floor_growth"] <= RSS_GROWTH_LIMIT for r in ranks),
                 "census": all(r["census"] is not None and all(b <= a for a, b in r["census"].values())
                               for r in ranks),
                 "threads": all(len(r["threads"]) == 1 for r in ranks),
                 "groups": all(len(r["groups"]) == 1 for r in ranks)}  # fmt: skip
    return out


def _slope(x: list[float], y: list[float]) -> float:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx if sxx else 0.0


_GROWTH = ("rss_growth", "rss_floor_growth", "rss_peak_growth")
COLUMNS: list[_results.Column] = [
    ("rank", lambda r: str(r["rank"])), ("RSS, first window (median MiB)", lambda r: f"{r['rss_first_mib']:.1f}"),
    ("last window", lambda r: f"{r['rss_last_mib']:.1f}"),
    ("growth: median / floor / peak", lambda r: " / ".join(f"{100 * r[k]:+.2f}%" for k in _GROWTH)),
    ("RSS slope (MiB / 100 steps)", lambda r: f"{r['rss_slope_mib_per_100']:+.2f}"),
    ("tensors / tensor KiB / objects, highest: first window -> last", lambda r: _census_cell(r["census"])),
    ("threads", lambda r: str(r["threads"])), ("process groups", lambda r: str(r["groups"])),
    ("median step, 1st half (s)", lambda r: f"{r['step_s_first_half']:.4f}"),
    ("2nd half (s)", lambda r: f"{r['step_s_second_half']:.4f}"), ("ratio", lambda r: f"{r['step_time_ratio']:.3f}"),
]  # fmt: skip


def _census_cell(census: dict[str, list[int]] | None) -> str:
    if census is None:
        return "not sampled"
    (t0, t1), (b0, b1), (o0, o1) = (census[k] for k in CENSUS)
    return f"{t0} -> {t1} / {b0 / 1024:.1f} -> {b1 / 1024:.1f} / {o0} -> {o1}"


def markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    window, ok = summary["ranks"][0]["window"], summary["ok"]
    setup = (
        f"`{meta['command']}`: tiny Llama ({meta['layers']} layers, GPT-2 vocabulary), {meta['seq_len']}-token "
        f"windows ({meta.get('windows', 100)} of them: an epoch is as many steps), batch 1, AdamW, Trainer + Ulysses "
        f"SP={meta['sp']} on {meta['sp']} CPU processes (gloo, one thread each). Warm-up: the first "
        f"{summary['warmup']} steps; memory compares the first and the last {window} measured steps. Wall time "
        f"{meta['wall_s']:.0f} s (a shared 2-core machine: step times are noisy)."
    )
    verdicts = (f"Verdicts: no more live tensors, tensor bytes or objects at the end: **{ok['census']}**; memory "
                f"floor growth <= {100 * RSS_GROWTH_LIMIT:g}%: **{ok['memory']}**; constant threads: "
                f"**{ok['threads']}**; constant process groups: **{ok['groups']}**.")  # fmt: skip
    table = _results.table(COLUMNS, [dict(r, rank=i) for i, r in enumerate(summary["ranks"])], align=" --- ")
    return _results.page(f"Drift: {summary['steps']} optimizer steps at SP={meta['sp']} ({meta['date']})", None,
                         setup, table, verdicts)  # fmt: skip


def plot(per_rank: list[list[dict[str, float]]], warmup: int, path: Path) -> None:
    rss_lines, time_lines, count_lines = [], [], []
    for rank, samples in enumerate(per_rank):
        steps, rss = [s["step"] for s in samples], [s["rss_mib"] for s in samples]
        rolling = [statistics.median(rss[max(i - 10, 0) : i + 1]) for i in range(len(rss))]
        rss_lines += [
            {"x": steps, "y": rss, "label": f"rank {rank}", "linewidth": 0.5, "alpha": 0.4, "marker": ""},
            {"x": steps, "y": rolling, "label": f"rank {rank} (median of 11)", "linewidth": 2, "marker": ""},
        ]
        time_lines.append({"x": steps, "y": [s["step_s"] for s in samples], "label": f"rank {rank}", "marker": ""})
        count_lines += [{"x": steps, "y": [s[k] for s in samples], "label": f"rank {rank} {name}", "marker": "",
                         "linestyle": style} for k, name, style in (("threads", "OS threads", "-"),
                                                                    ("groups", "process groups", "--"))]  # fmt: skip
    labels = (("resident MiB", rss_lines), ("step time (s)", time_lines), ("count", count_lines))
    panels = [{"title": "", "ylabel": label, "lines": lines, "xlabel": "optimizer step"} for label, lines in labels]
    panels[2]["ylim"] = (0, None)
    _results.line_plots(str(path), panels, cols=1, size=(8, 2.7), vline=warmup)


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "drift", timeout=1800)
    for flag, default in (("--steps", 300), ("--warmup", 50), ("--seq-len", 256), ("--sp", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--windows", type=int, default=100, help="windows in the data: an epoch is this many steps")
    parser.add_argument("--from-json", type=Path, help="re-render the table and plot from a saved run")
    parser.add_argument(
        "--judge", choices=("all", "counts"), default="all",
        help="verdicts behind the exit status: all, or counts only (census, threads, groups: a short run's RSS "
        "and step time are noise on a loaded machine, and the run still reports them)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        prefix = args.out or str(args.from_json.with_suffix(""))
        return write_results(saved["samples"], saved["meta"], args.warmup, prefix, args.judge)
    spec = {"impl": "hf_longctx", "engine": "ddp", "sp": args.sp, "steps": args.steps, "seq_len": args.seq_len,
            "data": "shakespeare", "windows": args.windows, "lr": 1e-3, "log": True, "threads": 1,
            "census": True}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-drift-") as tmp:
        timeout = max(args.timeout, 10 * args.steps)
        record = _harness.job(
            "benchmarks.worker:run", args.sp, timeout, Path(tmp), "drift", env=_harness.THREAD_ENV, spec=spec
        )
    if record["status"] != "ok":
        raise SystemExit(f"drift job {record['status']}: {record['error']}")
    command = "python -m benchmarks.drift" + ("" if args.steps == 300 else f" --steps {args.steps}")
    meta = {"date": datetime.date.today().isoformat(), "sp": args.sp, "seq_len": args.seq_len, "layers": 2,
            "wall_s": record["wall_s"], "command": command, "windows": args.windows}  # fmt: skip
    per_rank = [r["steps"] for r in record["result"]["ranks"]]
    return write_results(per_rank, meta, args.warmup, _harness.out(args), args.judge)


def write_results(
    per_rank: list[list[dict[str, float]]], meta: dict[str, Any], warmup: int, prefix: str, judge: str = "all"
) -> int:
    """Write `<prefix>.{json,md,png}`, print the table; 0 if every judged verdict holds (`judge`: all, counts)."""
    summary = summarize(per_rank, warmup, epoch=meta.get("windows", 100))
    plot(per_rank, warmup, Path(f"{prefix}.png"))
    data = {"meta": meta, "summary": summary, "samples": per_rank}
    _results.write(prefix, data, markdown(summary, meta), [f"{prefix}.png"])
    judged = COUNT_VERDICTS if judge == "counts" else tuple(summary["ok"])
    return 0 if all(summary["ok"][k] for k in judged) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Pure functions of the memory benchmark: medians, ratios against the targets, markdown and plots.

Aggregation: per run, the step time of a measured step is its slowest rank's, and the run's time is the
median over its measured steps; the run's peak is the largest process high-water mark over ranks. Per
(section, trainer, variant) the median over repeats.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks import _results
from benchmarks._harness import median, ratio, slowest_rank_median
from benchmarks._results import fmt

GiB = 2**30
TARGETS = {
    "peak_flags_over_upstream": 0.35,  # <=
    "time_flags_over_off": 1.1,  # <=
    "time_flags_over_ckpt": 1.1,  # <= (not an issue target: the same bound against checkpointing alone)
    "longest_ours_over_upstream": 4.0,  # >=
    "packed_time_over_upstream": 0.5,  # <=
    "packed_peak_over_upstream": 1.0,  # <=
}


def run_numbers(record: dict[str, Any]) -> dict[str, Any] | None:
    """Step time (s), peak (GiB) and first loss of one ok run, or None."""
    if record.get("status") != "ok":
        return None
    ranks = record["result"]["ranks"]
    warmup = record["spec"]["warmup"]
    cpu = [max(r["steps"][i].get("cpu_s", 0.0) for r in ranks) for i in range(warmup, len(ranks[0]["steps"]))]
    return {
        "step_s": slowest_rank_median(ranks, "step_s", warmup),
        "cpu_s": statistics.median(cpu) if cpu and all(cpu) else None,
        "peak_gib": max(r["process_peak_bytes"] for r in ranks) / GiB,
        "first_loss": ranks[0]["first_loss"],
        "reference_loss": record["result"].get("document_reference_loss", ranks[0].get("document_reference_loss")),
    }


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Cells of sections 1 and 2 (median over repeats), the section-3 ladder and every target ratio."""
    cells: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    ladder: list[dict[str, Any]] = []
    failures = []
    budget = data["meta"]["args"]["budget_gib"]
    for record in data["records"]:
        job = record["spec"]
        numbers = run_numbers(record)
        if numbers is None:
            failures.append(
                f"{job['section']} {job['variant']} {job['trainer']} S={job['seq_len']}: {record['status']}"
            )
        if job["section"] == "longest":
            peak = numbers["peak_gib"] if numbers else None
            ladder.append(
                {"variant": job["variant"], "seq_len": job["seq_len"], "peak_gib": peak, "status": record["status"]}
            )
            ladder[-1]["fits"] = peak is not None and peak <= budget
        elif numbers is not None:
            cells.setdefault((job["section"], job["trainer"], job["variant"]), []).append(numbers)
    table = {
        key: {k: median([r[k] for r in runs]) for k in ("step_s", "cpu_s", "peak_gib", "first_loss", "reference_loss")}
        | {"runs": len(runs)}
        for key, runs in cells.items()
    }

    def get(section: str, trainer: str, variant: str, key: str) -> float | None:
        return table.get((section, trainer, variant), {}).get(key)

    ratios = {}
    for trainer in ("trainer", "sft"):
        ratios[f"{trainer}_peak_flags_over_upstream"] = ratio(
            get("flags", trainer, "flags", "peak_gib"), get("flags", trainer, "upstream", "peak_gib")
        )
        for key, name in (("step_s", "time"), ("cpu_s", "cpu_time")):
            for base in ("off", "ckpt"):
                ratios[f"{trainer}_{name}_flags_over_{base}"] = ratio(
                    get("flags", trainer, "flags", key), get("flags", trainer, base, key)
                )
    for variant, tag in (("off", "packed"), ("loss", "packed_tiled_loss"), ("flags", "packed_flags")):
        for key, name in (("step_s", "time"), ("cpu_s", "cpu_time"), ("peak_gib", "peak")):
            ratios[f"{tag}_{name}_over_upstream"] = ratio(
                get("packed", "trainer", variant, key), get("packed", "trainer", "upstream", key)
            )
    longest = {
        v: max([r["seq_len"] for r in ladder if r["variant"] == v and r["fits"]], default=None)
        for v in ("upstream", "flags")
    }
    ratios["longest_ours_over_upstream"] = ratio(longest["flags"], longest["upstream"])
    return {"cells": table, "ladder": ladder, "longest": longest, "ratios": ratios, "failures": failures}


def _verdict(name: str, value: float | None) -> str:
    key = name.removeprefix("trainer_").removeprefix("sft_").replace("cpu_time", "time")
    key = key.replace("packed_flags_", "packed_").replace("packed_tiled_loss_", "packed_")
    target = TARGETS[key]
    if value is None:
        return "not measured"
    ok = value >= target if key == "longest_ours_over_upstream" else value <= target
    sign = ">=" if key == "longest_ours_over_upstream" else "<="
    return f"{value:.4f} (target {sign} {target}: {'reached' if ok else 'NOT reached'})"


_NAMES = {"off": "hf_longctx", "loss": "hf_longctx, tiled_loss", "flags": "hf_longctx, flags"}
_TIMES: list[_results.Column] = [("step s (wall)", lambda c: fmt(c["step_s"])),
                                 ("step s (CPU)", lambda c: fmt(c["cpu_s"]))]  # fmt: skip
FLAG_COLUMNS: list[_results.Column] = [("trainer", lambda c: c["trainer"]), ("variant", lambda c: c["variant"]),
    ("peak GiB / rank", lambda c: fmt(c["peak_gib"], ".3f")), *_TIMES, ("runs", lambda c: str(c["runs"]))]  # fmt: skip
PACKED_COLUMNS: list[_results.Column] = [("variant", lambda c: _NAMES.get(c["variant"], c["variant"])),
    ("peak GiB / rank", lambda c: fmt(c["peak_gib"], ".3f")), *_TIMES,
    ("first-step loss", lambda c: fmt(c["first_loss"], ".6f")),
    ("per-document reference loss", lambda c: fmt(c["reference_loss"], ".6f"))]  # fmt: skip
LADDER_COLUMNS: list[_results.Column] = [("variant", lambda r: r["variant"]), ("S", lambda r: str(r["seq_len"])),
    ("peak GiB / rank", lambda r: fmt(r["peak_gib"], ".3f")),
    ("fits", lambda r: "yes" if r["fits"] else "no")]  # fmt: skip


def render_markdown(meta: dict[str, Any], summary: dict[str, Any]) -> str:
    args, cells = meta["args"], summary["cells"]

    def rows(section: str, trainers: tuple[str, ...], variants: tuple[str, ...]) -> list[dict[str, Any]]:
        found = [(t, v, cells.get((section, t, v))) for t in trainers for v in variants]
        return [{**c, "trainer": t, "variant": v} for t, v, c in found if c]

    lines = [
        f"# Memory benchmark, CPU ({meta['date']})",
        "",
        _results.run_line(meta) + " (Other jobs shared the machine when the load exceeds the CPU count.) Tiny Llama "
        f"{meta['model']}, SP=2 (2 processes, one thread each), DeepSpeed ZeRO-1, fp32, sdpa. Flags: "
        f"{', '.join(meta['flags'])}; ckpt = activation checkpointing only.",
        "",
        f"## Flags on vs off vs upstream: S = {args['seq_len']}, vocabulary 32,768",
        "",
        *_results.table(FLAG_COLUMNS, rows("flags", ("trainer", "sft"), ("off", "ckpt", "flags", "upstream"))),
    ]
    packed = rows("packed", ("trainer",), ("off", "loss", "flags", "upstream"))
    if packed:
        docs = f"{args['seq_len'] // args['doc_len']} documents x {args['doc_len']} tokens"
        lines += ["", f"## Packed rows: {docs}, vocabulary 1,024", "", *_results.table(PACKED_COLUMNS, packed)]
    if summary["ladder"]:
        budget, longest = args["budget_gib"], summary["longest"]
        lines += ["", f"## Longest row that trains one step within {budget} GiB per rank (vocabulary 32,768)", ""]
        lines += _results.table(LADDER_COLUMNS, summary["ladder"])
        lines += ["", f"Longest: upstream {longest['upstream']}, hf_longctx with flags {longest['flags']}"]
        lines.append(f"(hf_longctx tried up to {args['max_seq']}).")
    lines += ["", "## Targets", ""]
    lines += ["Time ratios are given on wall time and on process CPU time (the robust one on a shared machine).", ""]
    lines += [f"- {name}: {_verdict(name, value)}" for name, value in summary["ratios"].items() if value is not None]
    if summary["failures"]:
        lines += ["", "Failed runs: " + "; ".join(summary["failures"])]
    return "\n".join(lines) + "\n"


PALETTE = {"off": "tab:blue", "ckpt": "tab:cyan", "loss": "tab:olive", "flags": "tab:green", "upstream": "tab:red"}


def plot(summary: dict[str, Any], prefix: str) -> list[str]:
    """Bar charts of peak and step time per trainer/variant (and packed rows), and the section-3 ladder."""
    cells, paths = summary["cells"], []
    for key, label, name in (("peak_gib", "peak resident GiB per rank", "peak"), ("step_s", "step time (s)", "time")):
        items, gaps = [], set()
        for section, trainer in (("flags", "trainer"), ("flags", "sft"), ("packed", "trainer")):
            for variant, color in PALETTE.items():
                c = cells.get((section, trainer, variant))
                if c and c[key] is not None:
                    items.append((f"{'packed' if section == 'packed' else trainer}\n{variant}", c[key], color))
            gaps.add(len(items) - 1)
        title = f"hf_longctx (off / flags) vs upstream DeepSpeed SP, SP=2: {label}"
        paths.append(_results.bars(f"{prefix}-{name}.png", title, label, items, gaps))
    if not summary["ladder"]:
        return paths
    lines = []
    for variant in ("upstream", "flags"):
        pts = [r for r in summary["ladder"] if r["variant"] == variant and r["peak_gib"] is not None]
        lines.append({"x": [r["seq_len"] for r in pts], "y": [r["peak_gib"] for r in pts], "label": variant,
                      "color": PALETTE[variant]})  # fmt: skip
    panel = {"title": "one optimizer step: peak memory vs length", "xlabel": "sequence length (tokens, SP=2)",
             "ylabel": "peak resident GiB per rank", "lines": lines, "logx": 2}  # fmt: skip
    return paths + [_results.line_plots(f"{prefix}-longest.png", [panel], size=(6, 4))]

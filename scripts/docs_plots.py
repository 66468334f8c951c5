"""Draw the docs site's plots that no benchmark draws itself, from committed results only (no run, no GPU).

    python scripts/docs_plots.py        # writes docs/images/planner-vs-measured.png

`planner-vs-measured.png`: every point of the two CPU planner checks (`python -m benchmarks.plan_validate --flags`,
benchmarks/results/2026-12-01-plan-cpu.json, and `--tiled`, 2026-12-04-plan-cpu-tiled.json): the peak memory the
planner predicted against the peak measured, and the relative error of each point against the +-10% tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "images"
PLANNER_RUNS = [
    ("2026-12-01-plan-cpu.json", "--flags grid (2026-12-01)", "tab:blue"),
    ("2026-12-04-plan-cpu-tiled.json", "--tiled grid (2026-12-04)", "tab:orange"),
]


def planner_vs_measured(out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, err) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.4]})
    names, errors, colors = [], [], []
    lo, hi = float("inf"), 0.0
    tolerance = None
    for filename, label, color in PLANNER_RUNS:
        data = json.loads((RESULTS / filename).read_text())
        tolerance = data["tolerance"]
        rows = [r for r in data["rows"] if r.get("measured_gib") is not None and r.get("predicted_gib") is not None]
        for calibration in (False, True):
            sel = [r for r in rows if (r["status"] == "calibration") == calibration]
            ax.scatter(
                [r["measured_gib"] for r in sel],
                [r["predicted_gib"] for r in sel],
                color=color,
                marker="s" if calibration else "o",
                facecolors="none" if calibration else color,
                label=f"{label}, calibration point" if calibration else label,
            )
        for r in rows:
            lo, hi = min(lo, r["measured_gib"], r["predicted_gib"]), max(hi, r["measured_gib"], r["predicted_gib"])
            if r["status"] != "calibration":
                names.append(r["name"])
                errors.append(100 * (r["predicted_gib"] - r["measured_gib"]) / r["measured_gib"])
                colors.append(color)
    line = [lo * 0.9, hi * 1.1]
    ax.plot(line, line, color="gray", lw=1, label="predicted = measured")
    ax.fill_between(
        line,
        [v * (1 - tolerance) for v in line],
        [v * (1 + tolerance) for v in line],
        color="gray",
        alpha=0.15,
        label=f"+-{tolerance:.0%}",
    )
    ax.set_xlim(line)
    ax.set_ylim(line)
    ax.set_xlabel("measured peak GiB per rank (CPU, VmHWM)")
    ax.set_ylabel("hf-longctx plan: predicted GiB")
    ax.set_title("hf-longctx plan vs measured (CPU Trainer runs)")
    ax.legend(fontsize=7, loc="upper left")

    y = range(len(names))
    err.barh(list(y), errors, color=colors)
    err.axvline(0, color="gray", lw=1)
    for bound in (-100 * tolerance, 100 * tolerance):
        err.axvline(bound, color="tab:red", ls=":", lw=1)
    err.set_yticks(list(y), names, fontsize=6)
    err.invert_yaxis()
    err.set_xlabel("prediction error, % of measured (red: tolerance)")
    err.set_title("every predicted point")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return out


def main() -> None:
    print(planner_vs_measured(IMAGES / "planner-vs-measured.png"))


if __name__ == "__main__":
    main()

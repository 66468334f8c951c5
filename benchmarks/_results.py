"""The results writer every benchmark shares: columns and markdown tables, one page (`page`), the JSON + markdown
pair (`write`), line and bar plots."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

MiB, GiB = 2**20, 2**30
RESULTS = Path(__file__).resolve().parent / "results"
Column = tuple[str, Callable[[dict[str, Any]], str]]


def fmt(x: float | None, spec: str = ".2f", scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x / scale, spec)


def seq(s: int) -> str:
    """A sequence length as the tables write it: 4096 -> "4K"."""
    return f"{s // 1024}K" if s % 1024 == 0 else str(s)


def col(header: str, key: str, spec: str = ".2f", scale: float = 1.0) -> Column:
    """A column showing `row[key]` (n/a when missing or None)."""
    return header, lambda r: fmt(r.get(key), spec, scale)


def target(value: float | None, limit: float, at_least: bool = False) -> str:
    """A ratio against its target: "<= 0.55: reached" (or "NOT reached", "not measured")."""
    sign = ">=" if at_least else "<="
    if value is None:
        return f"{sign} {limit}: not measured"
    return f"{sign} {limit}: " + ("reached" if (value >= limit if at_least else value <= limit) else "NOT reached")


def table(columns: Sequence[Column], rows: Sequence[dict[str, Any]], align: str = "---:") -> list[str]:
    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + f"{align}|" * len(columns)]
    return out + ["| " + " | ".join(fn(r) for _, fn in columns) + " |" for r in rows]


def run_line(meta: dict[str, Any]) -> str:
    """Command, wall time, runs and machine load: the first line of every results page."""
    return (
        f"Command: `{meta.get('command', '?')}`; {meta.get('runs_ok', '?')} runs ok, "
        f"{meta.get('runs_failed', 0)} failed, "
        f"total {fmt(meta.get('total_wall_s'), '.0f')} s; load average {meta.get('load_start', '?')} at the start, "
        f"{meta.get('load_end', '?')} at the end ({meta.get('cpus', '?')} CPUs)."
    )


def page(title: str, meta: dict[str, Any] | None, *blocks: str | Sequence[str]) -> str:
    """A results page: the title, the run line of `meta` (when given), each block (text or lines), failed runs."""
    failed = [["Failed runs:", *[f"- {f}" for f in meta["failures"]]]] if meta and meta.get("failures") else []
    parts = [f"# {title}", *([run_line(meta)] if meta else [])]
    return "\n\n".join(parts + [b if isinstance(b, str) else "\n".join(b) for b in [*blocks, *failed]]) + "\n"


def write(prefix: str | Path, data: dict[str, Any], markdown: str, plots: Sequence[str] = ()) -> str:
    """`<prefix>.json` (everything measured) and `<prefix>.md` (the page, with its plots); prints the page."""
    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(data, indent=1))
    text = markdown + "".join(f"\n![{Path(p).name}]({Path(p).name})\n" for p in plots)
    Path(f"{prefix}.md").write_text(text)
    print(text)
    print("wrote", f"{prefix}.json", f"{prefix}.md", *plots, flush=True)
    return text


def line(rows: Iterable[dict[str, Any]], y: Callable[[dict[str, Any]], float | None], x: str = "seq_len",
         **style: Any) -> list[dict[str, Any]]:  # fmt: skip
    """One `line_plots` line through `rows` (sorted by `x`, rows without a `y` left out); [] when none has one."""
    pts = sorted((r[x], v) for r in rows if (v := y(r)) is not None)
    return [{"x": [p[0] for p in pts], "y": [p[1] for p in pts], **style}] if pts else []


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def line_plots(
    path: str, panels: Sequence[dict[str, Any]], cols: int | None = None, size=(6.5, 4.5), vline: float | None = None
) -> str:
    """One figure of line panels; a panel is `{"title", "xlabel", "ylabel", "lines": [{"x", "y", "label",
    **matplotlib style}], "logx": base or None, "logy": bool, "hlines": [{"y", **style}], "ylim": (lo, hi)}`;
    `vline` marks one x in every panel (e.g. the end of a warm-up)."""
    plt = _pyplot()
    cols = cols or len(panels)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        for line in panel["lines"]:
            style = {k: v for k, v in line.items() if k not in ("x", "y")}
            ax.plot(line["x"], line["y"], **({"marker": "o"} | style))
        for h in panel.get("hlines", ()):
            ax.axhline(h["y"], **{k: v for k, v in h.items() if k != "y"})
        if vline is not None:
            ax.axvline(vline, color="grey", linestyle=":")
        if panel.get("logx"):
            ax.set_xscale("log", base=panel["logx"])
        if panel.get("logy"):
            ax.set_yscale("log")
        if panel.get("ylim"):
            ax.set_ylim(*panel["ylim"])
        ax.set(xlabel=panel.get("xlabel", "sequence length S (tokens)"), ylabel=panel["ylabel"], title=panel["title"])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(plt, fig, path)


def bars(path: str, title: str, ylabel: str, items: Sequence[tuple[str, float, str]], gap_after: set[int]) -> str:
    """A bar chart of `(tick, height, color)` items, with a gap after the indices in `gap_after`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    xs, x = [], 0.0
    for i in range(len(items)):
        xs.append(x)
        x += 1.5 if i in gap_after else 1.0
    ax.bar(xs, [h for _, h, _ in items], color=[c for _, _, c in items])
    ax.set_xticks(xs, [t for t, _, _ in items], fontsize=7)
    ax.set(ylabel=ylabel, title=title)
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

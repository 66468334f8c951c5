"""Pure functions of the A/B benchmark (`benchmarks.run`): theory bytes, `run_summary` (one run), `cell_rows` (one
(impl, SP, S) cell: medians over repeats and ratios hf_longctx / upstream, bytes / theory, activation memory /
SP=1), `render_markdown`, `headline` and `plot`. How ranks and repeats are combined: benchmarks/README.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import _results
from benchmarks._harness import median, ratio, slowest_rank_median
from benchmarks._measure import OP_CATEGORIES
from benchmarks._results import Column, MiB, col
from benchmarks._results import fmt as _fmt
from benchmarks._results import seq as _seq
from benchmarks._results import table as _table
from hf_longctx.instrument import ulysses_min_bytes

IMPLS = ("hf_longctx", "upstream")
BASELINE = "none"  # the SP=1 run
ELEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Run-level metrics (see `run_summary` for how ranks are combined)
METRICS = ("step_s", "iter_s", "act_bytes", "mem_before", "process_peak_bytes", "a2a_bytes", "a2a_calls", "a2a_s",
           "a2a_s_min", "a2a_s_max", "hf_a2a_bytes", "other_comm_bytes", "other_comm_s", "ops_attention_s",
           "ops_matmul_s", "ops_communication_s", "ops_other_s", "ops_total_s")  # fmt: skip


def theory_bytes_per_step(heads: int, kv_heads: int, head_dim: int, layers: int, seq_len: int, sp: int,
                          elem_bytes: int, recompute: bool = False) -> float:  # fmt: skip
    """Ulysses minimum bytes one rank sends per training step: every layer's forward (q, k, v in, output
    back: `(2*H*d + 2*H_kv*d) * (S/P) * (P-1)/P * bytes`) and its backward (the same volume again); with
    activation checkpointing (`recompute`) the forward exchange runs a second time in the backward."""
    passes = 3 if recompute else 2
    return passes * layers * ulysses_min_bytes(heads, kv_heads, head_dim, seq_len, sp, elem_bytes)


def run_summary(result: dict[str, Any], warmup: int) -> dict[str, float | None]:
    """Collapse one worker result (`{"ranks": [{"steps": [...], ...}, ...]}`) to run-level numbers.

    The first `warmup` steps of every rank are skipped.
    """
    ranks = result["ranks"]
    measured = [r["steps"][warmup:] for r in ranks]
    n = min(len(s) for s in measured)
    if n == 0:
        raise ValueError(f"no measured steps (warmup={warmup}, steps per rank {[len(r['steps']) for r in ranks]})")

    def per_rank(key: str) -> list[float]:
        return [median(step[key] for step in steps) for steps in measured]

    def other(steps: list[dict[str, Any]], index: int) -> float:
        return median(sum(v[index] for v in step.get("other_comm", {}).values()) for step in steps)

    profiled = [r["op_profile"] for r in ranks if r.get("op_profile")]
    ops = {
        f"ops_{c}_s": statistics.fmean(p[c] for p in profiled) if profiled else None for c in (*OP_CATEGORIES, "total")
    }
    return {
        **ops,
        "step_s": slowest_rank_median(ranks, "step_s", warmup),
        "iter_s": slowest_rank_median(ranks, "iter_s", warmup),
        "act_bytes": max(per_rank("act_bytes")),
        "mem_before": max(per_rank("mem_before")),
        "process_peak_bytes": max(r["process_peak_bytes"] for r in ranks),
        "a2a_bytes": statistics.fmean(per_rank("a2a_bytes")),
        "a2a_calls": statistics.fmean(per_rank("a2a_calls")),
        # exposed communication: per rank the time inside all_to_all (mean over ranks); the spread between
        # ranks is mostly waiting for the slowest rank to arrive (min ~ the exchange itself)
        "a2a_s": statistics.fmean(per_rank("a2a_s")),
        "a2a_s_min": min(per_rank("a2a_s")),
        "a2a_s_max": max(per_rank("a2a_s")),
        "hf_a2a_bytes": statistics.fmean(per_rank("hf_a2a_bytes")),
        "other_comm_bytes": statistics.fmean(other(s, 1) for s in measured),
        "other_comm_s": max(other(s, 2) for s in measured),
    }


def cell_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group successful runs by (sp, seq_len) and build one row per cell with medians and ratios.

    Each run is `{"spec": {...}, "status": "ok", "summary": run_summary(...)}`; SP=1 baselines
    (`impl == "none"`) are attached to every cell with the same sequence length (and model).
    """
    by_key: dict[tuple, dict[str, list[dict]]] = {}
    for r in runs:
        if r.get("status") == "ok" and r.get("summary") and r["spec"]["impl"] != BASELINE:
            spec = r["spec"]
            key = (spec["model"].get("name", ""), spec["sp"], spec["seq_len"])
            by_key.setdefault(key, {}).setdefault(spec["impl"], []).append(r)
    baselines = {(b["model"], b["seq_len"]): b for b in baseline_rows(runs)}

    rows = []
    for (model_name, sp, seq_len), impls in sorted(by_key.items()):
        spec = next(iter(impls.values()))[0]["spec"]
        m = spec["model"]
        theory = theory_bytes_per_step(m["heads"], m["kv_heads"], m["head_dim"], m["layers"], seq_len, sp,
                                       ELEM_BYTES[spec["dtype"]], bool(spec.get("gradient_checkpointing")))  # fmt: skip
        row: dict[str, Any] = {"model": model_name, "sp": sp, "seq_len": seq_len, "theory_bytes": theory}
        for impl in IMPLS:
            runs_i = impls.get(impl, [])
            row[impl] = _medians([r["summary"] for r in runs_i]) if runs_i else None
            row[f"{impl}_repeats"] = len(runs_i)
        row["sp1"] = baselines.get((model_name, seq_len))
        hf, up, sp1 = row["hf_longctx"] or {}, row["upstream"] or {}, row["sp1"] or {}
        row["ratio"] = {m_: ratio(hf.get(m_), up.get(m_)) for m_ in METRICS}
        row["bytes_vs_theory"] = {impl: ratio((row[impl] or {}).get("a2a_bytes"), theory) for impl in IMPLS}
        row["hf_recorded_vs_theory"] = ratio(hf.get("hf_a2a_bytes"), theory)
        row["act_vs_sp1"] = {impl: ratio((row[impl] or {}).get("act_bytes"), sp1.get("act_bytes")) for impl in IMPLS}
        rows.append(row)
    return rows


def _medians(summaries: list[dict]) -> dict[str, float | None]:
    return {m: median(s.get(m) for s in summaries) for m in METRICS}


def baseline_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median SP=1 numbers per (model, seq_len)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("status") == "ok" and r["spec"]["impl"] == BASELINE:
            groups.setdefault((r["spec"]["model"].get("name", ""), r["spec"]["seq_len"]), []).append(r["summary"])
    return [{"model": k[0], "seq_len": k[1], "repeats": len(v), **_medians(v)} for k, v in sorted(groups.items())]


# ---- rendering ------------------------------------------------------------------------------------


def _get(row: dict, impl: str, key: str) -> float | None:
    return (row.get(impl) or {}).get(key)


def _val(impl: str, key: str, spec: str = ".2f", scale: float = 1.0) -> Callable[[dict[str, Any]], str]:
    return lambda r: _fmt(_get(r, impl, key), spec, scale)


def _share(impl: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: _fmt(ratio(_get(r, impl, "a2a_s"), _get(r, impl, "step_s")), ".1%")


def _spread(impl: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: f"{_val(impl, 'a2a_s_min', '.3f')(r)}-{_val(impl, 'a2a_s_max', '.3f')(r)}"


def _pair(title: str, key: str, spec: str = ".2f", scale: float = 1.0) -> list[Column]:
    """`title hf` and `title up` columns of a run-level metric."""
    return [(f"{title} {tag}", _val(impl, key, spec, scale)) for impl, tag in zip(IMPLS, ("hf", "up"), strict=True)]


def _ratio_col(title: str, group: str, key: str) -> Column:
    return (title, lambda r: _fmt(r[group][key], ".3f"))


CELL: list[Column] = [("SP", lambda r: str(r["sp"])), ("S", lambda r: _seq(r["seq_len"]))]
TIME_COLUMNS: list[Column] = CELL + [
    ("hf_longctx", _val("hf_longctx", "step_s")), ("upstream", _val("upstream", "step_s")),
    _ratio_col("ratio hf/up", "ratio", "step_s"), *_pair("iter", "iter_s"), ("SP=1", _val("sp1", "step_s")),
]  # fmt: skip
MEMORY_COLUMNS: list[Column] = CELL + [
    *_pair("act", "act_bytes", ".0f", MiB), ("act SP=1", _val("sp1", "act_bytes", ".0f", MiB)),
    _ratio_col("hf / SP=1", "act_vs_sp1", "hf_longctx"), _ratio_col("up / SP=1", "act_vs_sp1", "upstream"),
    _ratio_col("hf / up", "ratio", "act_bytes"), *_pair("before-step", "mem_before", ".0f", MiB),
    *_pair("process peak", "process_peak_bytes", ".0f", MiB),
    ("process peak SP=1", _val("sp1", "process_peak_bytes", ".0f", MiB)),
]  # fmt: skip
BYTES_COLUMNS: list[Column] = CELL + [
    ("theory", lambda r: _fmt(r["theory_bytes"], ".2f", MiB)),
    ("hf_longctx", _val("hf_longctx", "a2a_bytes", ".2f", MiB)),
    _ratio_col("hf / theory", "bytes_vs_theory", "hf_longctx"),
    ("hf (record_collectives)", _val("hf_longctx", "hf_a2a_bytes", ".2f", MiB)),
    ("upstream", _val("upstream", "a2a_bytes", ".2f", MiB)), _ratio_col("up / theory", "bytes_vs_theory", "upstream"),
    *_pair("a2a calls", "a2a_calls", ".0f"),
]  # fmt: skip
COMM_COLUMNS: list[Column] = CELL + [
    *_pair("a2a time", "a2a_s", ".3f"), _ratio_col("ratio hf/up", "ratio", "a2a_s"),
    ("min-max rank hf", _spread("hf_longctx")), ("min-max rank up", _spread("upstream")),
    ("a2a share of step hf", _share("hf_longctx")), ("a2a share up", _share("upstream")),
    *_pair("other coll. MiB", "other_comm_bytes", ".1f", MiB), *_pair("other coll. s", "other_comm_s", ".3f"),
]  # fmt: skip


def _kernels(row: dict[str, Any], impl: str) -> float | None:
    a, m = _get(row, impl, "ops_attention_s"), _get(row, impl, "ops_matmul_s")
    return None if a is None or m is None else a + m


def floor_ratio(row: dict[str, Any]) -> float | None:
    """The lowest hf_longctx / upstream step-time ratio possible if all of hf_longctx's time outside the
    attention kernel and matmuls vanished: both run those on identical shapes (profiled step)."""
    return ratio(_kernels(row, "hf_longctx"), _get(row, "upstream", "ops_total_s"))


def no_comm_ratio(row: dict[str, Any]) -> float | None:
    """hf_longctx / upstream if hf_longctx's communication took no time and the rest stayed (profiled step)."""
    total, comm = _get(row, "hf_longctx", "ops_total_s"), _get(row, "hf_longctx", "ops_communication_s")
    return None if total is None or comm is None else ratio(total - comm, _get(row, "upstream", "ops_total_s"))


OPS_COLUMNS: list[Column] = CELL + [
    *[(f"{c} {tag}", _val(impl, f"ops_{c}_s", ".3f")) for impl, tag in zip(IMPLS, ("hf", "up"), strict=True)
      for c in (*OP_CATEGORIES, "total")],
    ("attn+mm share up", lambda r: _fmt(ratio(_kernels(r, "upstream"), _get(r, "upstream", "ops_total_s")), ".1%")),
    ("profiled hf/up", lambda r: _fmt(r["ratio"]["ops_total_s"], ".3f")),
    ("no-comm hf/up", lambda r: _fmt(no_comm_ratio(r), ".3f")), ("floor hf/up", lambda r: _fmt(floor_ratio(r), ".3f")),
]  # fmt: skip
BASELINE_COLUMNS: list[Column] = [
    ("S", lambda b: _seq(b["seq_len"])), col("step s", "step_s"), col("act MiB", "act_bytes", ".0f", MiB),
    col("before-step MiB", "mem_before", ".0f", MiB), col("process peak MiB", "process_peak_bytes", ".0f", MiB),
]  # fmt: skip
SECTIONS = (
    ("Step time (s)", TIME_COLUMNS),
    ("Memory per rank (MiB)", MEMORY_COLUMNS),
    ("all_to_all bytes per rank per step (MiB) vs the Ulysses minimum", BYTES_COLUMNS),
    ("Exposed communication per step (s) and other collectives", COMM_COLUMNS),
    ("Where the time goes: one profiled step per run (s of self CPU time, mean over ranks)", OPS_COLUMNS),
)


def render_markdown(meta: dict[str, Any], rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]) -> str:
    """The results page: setup, then one table per metric family (medians; ratio = hf_longctx / upstream)."""
    models = sorted({r["model"] for r in rows} | {b["model"] for b in base})
    out = [f"# hf_longctx vs upstream DeepSpeed SP: `{meta.get('profile', '?')}` profile ({meta.get('date', '?')})", ""]
    out += [
        _results.run_line(meta) + "  ",
        f"Versions: {meta.get('versions', {})}.  ",
        f"Per run: {meta.get('warmup', '?')} warm-up + {meta.get('steps', '?')} measured optimizer steps, batch 1, "
        f"DeepSpeed ZeRO-{meta.get('zero_stage', 1)}, HF Trainer; {meta.get('repeats', '?')} repeats per cell in "
        "alternating order (A B, then B A, ...). Model(s): "
        + "; ".join(f"`{name}` {desc}" for name, desc in meta.get("models", {}).items())
        + ".",
        "",
        "Medians over measured steps and repeats. Step time: slowest rank. Memory: worst rank. "
        "`act` = peak resident memory during the step minus resident memory at the step's start "
        "(activations, gradients and temporaries; weights, optimizer state and DeepSpeed buffers exist before "
        "the step). Bytes: what one rank sends to other ranks in `all_to_all_single` per step; theory = "
        "2 x layers x `(2*H*d + 2*H_kv*d) * (S/P) * (P-1)/P * bytes` (3 x with activation checkpointing). "
        "Exposed comm: wall time inside `all_to_all_single` per step, mean over ranks (the Ulysses exchange is "
        "synchronous: nothing overlaps it; the rank spread is mostly waiting for the slowest rank). "
        "Where the time goes: one extra step per run (not in the medians) under `torch.profiler`, self CPU "
        "time split into the attention kernel, matmuls, communication (collectives, their autograd nodes "
        "and the layout copies inside them, waits included) and everything else; `floor` = "
        "(attention + matmul of hf_longctx) / upstream's total, the ratio left if all other time vanished; "
        "`no-comm` = (hf_longctx's total - its communication) / upstream's total.",
        "",
    ]
    for model in models:
        mrows = [r for r in rows if r["model"] == model]
        mbase = [b for b in base if b["model"] == model]
        out += [f"## Model `{model}`", ""] if len(models) > 1 else []
        for title, columns in SECTIONS:
            if columns is not OPS_COLUMNS or any(_get(r, i, "ops_total_s") for r in mrows for i in IMPLS):
                out += [f"### {title}", ""] + _table(columns, mrows) + [""]  # (no profiled step on the GPU profile)
        out += ["### SP=1 baseline (one process, no SP)", ""] + _table(BASELINE_COLUMNS, mbase) + [""] if mbase else []
    failed = meta.get("failures") or []
    return "\n".join(out + (["### Failed runs", ""] + [f"- {f}" for f in failed] + [""] if failed else []))


def headline(rows: Sequence[dict[str, Any]], min_seq: int = 8192) -> dict[str, Any]:
    """The acceptance numbers: step-time ratio at S >= min_seq, worst bytes/theory per SP, act memory ratios."""
    out: dict[str, Any] = {
        k: {} for k in ("step_ratio_long", "step_ratio_floor_long", "bytes_vs_theory_max", "act_vs_sp1")
    }
    for r in rows:
        key = f"{r['model']}/sp{r['sp']}" if r["model"] else f"sp{r['sp']}"
        cell = f"{key}/S{_seq(r['seq_len'])}"
        if r["seq_len"] >= min_seq:
            out["step_ratio_long"][cell], out["step_ratio_floor_long"][cell] = r["ratio"]["step_s"], floor_ratio(r)
        for impl, v in r["bytes_vs_theory"].items():
            if v is not None:
                d = out["bytes_vs_theory_max"].setdefault(impl, {})
                d[key] = max(d.get(key, 0.0), v)
        out["act_vs_sp1"][cell] = r["act_vs_sp1"]
    return out


_LINES = ("-", "--", "-.", ":")
# hf_longctx: large hollow circles, upstream: small filled squares, so identical curves stay visible
_STYLE = {"hf_longctx": {"color": "tab:blue", "marker": "o", "markersize": 9, "markerfacecolor": "none"},
          "upstream": {"color": "tab:orange", "marker": "s", "markersize": 4}}  # fmt: skip


def plot(rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]], prefix: str) -> list[str]:
    """Write `<prefix>-time.png`, `-memory.png`, `-bytes.png` (one panel per model); returns the paths."""
    sps = sorted({r["sp"] for r in rows})
    models = sorted({r["model"] for r in rows} | {b["model"] for b in base})

    def lines(model: str, value: Callable[[dict[str, Any], str], float | None]) -> list[dict[str, Any]]:
        return [ln for i, sp in enumerate(sps) for impl in IMPLS for ln in _results.line(
            [r for r in rows if (r["model"], r["sp"]) == (model, sp)], lambda r, impl=impl: value(r, impl),
            label=f"{impl} SP={sp}", linestyle=_LINES[i % len(_LINES)], **_STYLE[impl])]  # fmt: skip

    def titled(title: str, model: str) -> str:
        return f"{title} ({model})" if len(models) > 1 else title

    def scaled(key: str, scale: float) -> Callable[[dict[str, Any], str], float | None]:
        return lambda r, impl: _scale(_get(r, impl, key), scale)

    def sp1(model: str, key: str, scale: float) -> list[dict[str, Any]]:
        pts = [b for b in base if b["model"] == model]
        style = {"label": "SP=1 (no SP)", "color": "black", "linestyle": ":", "marker": "^"}
        return _results.line(pts, lambda b: _scale(b.get(key), scale), **style)

    def theory(model: str) -> list[dict[str, Any]]:
        style = {"color": "gray", "lw": 4, "alpha": 0.35, "marker": ""}
        return [ln for i, sp in enumerate(sps) for ln in _results.line(
            [r for r in rows if (r["model"], r["sp"]) == (model, sp)], lambda r: r["theory_bytes"] / MiB,
            label=f"theory SP={sp}", linestyle=_LINES[i % len(_LINES)], **style)]  # fmt: skip

    paths = []
    for name, key, scale, ylabel, title in (
        ("time", "step_s", 1.0, "step time (s)", "Step time vs sequence length"),
        ("memory", "act_bytes", MiB, "activation + transient memory per rank (MiB)", "Memory per rank vs S"),
    ):
        panels = [{"title": titled(title, m), "ylabel": ylabel, "logx": 2, "logy": True,
                   "lines": lines(m, scaled(key, scale)) + sp1(m, key, scale)} for m in models]  # fmt: skip
        paths.append(_results.line_plots(f"{prefix}-{name}.png", panels, size=(7, 4.5)))
    top = max(1.15, *(r["bytes_vs_theory"][i] or 0 for r in rows for i in IMPLS)) + 0.05
    bound = [{"y": 1.0, "color": "gray", "lw": 1},
             {"y": 1.05, "color": "red", "lw": 1, "linestyle": ":", "label": "acceptance bound 1.05"}]  # fmt: skip
    panels = []
    for m in models:
        panels.append({"title": titled("Collective bytes vs Ulysses minimum", m), "logx": 2, "logy": True,
                       "ylabel": "all_to_all MiB sent per rank per step",
                       "lines": theory(m) + lines(m, scaled("a2a_bytes", MiB))})  # fmt: skip
        panels.append({"title": titled("Measured bytes / theoretical minimum", m), "ylabel": "measured / theory",
                       "lines": lines(m, lambda r, impl: r["bytes_vs_theory"][impl] or None), "logx": 2,
                       "hlines": bound, "ylim": (0.9, top)})  # fmt: skip
    paths.append(_results.line_plots(f"{prefix}-bytes.png", panels, cols=2))
    return paths


def _scale(x: float | None, scale: float) -> float | None:
    return None if x is None else x / scale

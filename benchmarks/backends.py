"""SP backends side by side: Ulysses, ring (pass-KV and all-gather-KV), hybrid and upstream DeepSpeed SP.

    python -m benchmarks.backends                          # reduced CPU grid (P = 2, 4; S = 4K; 1 repeat)
    python -m benchmarks.backends --seq-lens 4096,8192,16384 --repeats 2    # the full grid (quiet machine)
    python -m benchmarks.backends --from-json benchmarks/results/<date>-backends-cpu.json   # re-render

Same worker, model, data, Trainer and ZeRO-1 engine as `benchmarks.run` (see benchmarks/README.md);
only `spec["sp_options"]` differs between the hf_longctx rows. Per (P, S) cell every implementation
runs `--repeats` times, the order reversed after each pass (drift cancels); one SP=1 baseline per S.
Per run: step time (slowest rank, median of measured steps), activation memory per rank, and the bytes
each rank sends per step against `hf_longctx.attention.cost` (2 layers x forward + backward): the
all-to-all counter for Ulysses and upstream, hf_longctx's own counters for the ring's point-to-point,
all-gather and reduce-scatter traffic. Hybrid needs P >= 4 (Ulysses degree 2 x ring P / 2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import _harness, _results, report
from benchmarks._results import MiB, fmt
from benchmarks.run import PROFILES, RESULTS, failure, launch, make_spec
from hf_longctx.attention.cost import Bytes, hybrid_bytes, ring_bytes, ulysses_bytes

K = 1024
# label -> (worker impl, ParallelismConfig options)
IMPLS: dict[str, tuple[str, dict[str, Any]]] = {
    "ulysses": ("hf_longctx", {}),
    "ring-p2p": ("hf_longctx", {"sp_backend": "ring", "ring_variant": "p2p"}),
    "ring-allgather": ("hf_longctx", {"sp_backend": "ring", "ring_variant": "allgather"}),
    "hybrid": ("hf_longctx", {"sp_backend": "hybrid", "ulysses_degree": 2, "ring_variant": "p2p"}),
    "upstream": ("upstream", {}),
}
RING_OPS = ("ring_p2p", "ring_all_gather", "ring_reduce_scatter")


def plan(sps: list[int], seq_lens: list[int], repeats: int, steps: int) -> list[dict[str, Any]]:
    """Worker specs: per S the SP=1 baseline, then every (P, impl) cell, order reversed on every pass."""
    profile = dict(PROFILES["cpu"], steps=steps)
    model = "tiny-llama"
    specs, flip = [], False
    for seq in seq_lens:
        specs.append(dict(make_spec(profile, model, report.BASELINE, 1, seq), label="sp1"))
        for sp in sps:
            labels = [name for name in IMPLS if name != "hybrid" or sp >= 4]
            for rep in range(repeats):
                for label in labels[::-1] if flip else labels:
                    impl, options = IMPLS[label]
                    spec = make_spec(profile, model, impl, sp, seq)
                    specs.append(dict(spec, sp_options=options, label=label, rep=rep, op_profile=False))
                flip = not flip
    return specs


def theory(spec: dict[str, Any]) -> float:
    """Bytes one rank sends per training step (all layers, forward + backward) for this run's backend."""
    m, sp, seq = spec["model"], spec["sp"], spec["seq_len"]
    elem = report.ELEM_BYTES[spec["dtype"]]
    args = (m["heads"], m["kv_heads"], m["head_dim"], seq)
    label = spec["label"]
    if label in ("ulysses", "upstream"):
        per_layer: Bytes = ulysses_bytes(*args, sp, sp, elem)
    elif label.startswith("ring"):
        per_layer = ring_bytes(m["kv_heads"], m["head_dim"], seq, sp, elem, 4, IMPLS[label][1]["ring_variant"])
    else:
        options = IMPLS[label][1]
        per_layer = hybrid_bytes(*args, sp, options["ulysses_degree"], elem, 4, options["ring_variant"])
    return m["layers"] * per_layer.total


def measured_bytes(result: dict[str, Any], label: str, warmup: int) -> float:
    """Mean over ranks of the median bytes per measured step that the backend's own exchanges sent."""
    per_rank = []
    for rank in result["ranks"]:
        steps = rank["steps"][warmup:]
        if label in ("ulysses", "upstream"):
            per_step = [s["a2a_bytes"] for s in steps]
        else:
            ops = RING_OPS + (("all_to_all",) if label == "hybrid" else ())
            per_step = [sum(s["hf_ops"].get(op, [0, 0, 0])[1] for op in ops) for s in steps]
        per_rank.append(statistics.median(per_step))
    return statistics.fmean(per_rank)


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (P, S, label): medians over repeats and the ratios the README quotes."""
    base = {r["spec"]["seq_len"]: r["summary"] for r in runs if r["status"] == "ok" and r["spec"]["label"] == "sp1"}
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["status"] == "ok" and r["spec"]["label"] != "sp1":
            cells.setdefault((r["spec"]["sp"], r["spec"]["seq_len"], r["spec"]["label"]), []).append(r)
    out = []
    for (sp, seq, label), group in sorted(
        cells.items(), key=lambda kv: (kv[0][0], kv[0][1], list(IMPLS).index(kv[0][2]))
    ):
        med = {
            k: _harness.median(g["summary"].get(k) for g in group)
            for k in ("step_s", "act_bytes", "process_peak_bytes")
        }
        sent = _harness.median(g["bytes"] for g in group)
        want = theory(group[0]["spec"])
        sp1 = base.get(seq, {})
        row = {"sp": sp, "seq_len": seq, "label": label, "repeats": len(group), **med, "bytes": sent, "theory": want}
        row["bytes_vs_theory"] = _harness.ratio(sent, want)
        row["act_vs_sp1"] = _harness.ratio(med["act_bytes"], sp1.get("act_bytes"))
        row["sp1_step_s"] = sp1.get("step_s")
        out.append(row)
    for row in out:
        ref = next(
            (r for r in out if (r["sp"], r["seq_len"], r["label"]) == (row["sp"], row["seq_len"], "ulysses")), None
        )
        row["step_vs_ulysses"] = _harness.ratio(row["step_s"], ref["step_s"]) if ref else None
    return out


COLUMNS: list[_results.Column] = [
    ("SP", lambda r: str(r["sp"])),
    ("S", lambda r: _results.seq(r["seq_len"])),
    ("backend", lambda r: r["label"]),
    ("step s", lambda r: fmt(r["step_s"])),
    ("vs Ulysses", lambda r: fmt(r["step_vs_ulysses"], ".3f")),
    ("SP=1 step s", lambda r: fmt(r["sp1_step_s"])),
    ("act MiB/rank", lambda r: fmt(r["act_bytes"], ".0f", MiB)),
    ("act / SP=1", lambda r: fmt(r["act_vs_sp1"], ".3f")),
    ("MiB sent/step", lambda r: fmt(r["bytes"], ".2f", MiB)),
    ("theory MiB", lambda r: fmt(r["theory"], ".2f", MiB)),
    ("measured / theory", lambda r: fmt(r["bytes_vs_theory"], ".3f")),
]


def markdown(meta: dict[str, Any], table: list[dict[str, Any]]) -> str:
    lines = [f"# SP backends on the `cpu` profile ({meta['date']})", "", _results.run_line(meta)]
    lines += [f"Model: {meta['model']}. Medians of {meta['steps']} measured steps per run.", ""]
    lines += _results.table(COLUMNS, table)
    if meta["failures"]:
        lines += ["", "Failed runs:", *[f"- {f}" for f in meta["failures"]]]
    return "\n".join(lines) + "\n"


def plot(table: list[dict[str, Any]], prefix: str) -> list[str]:
    """`<prefix>-time.png` and `-memory.png`: one panel per SP size, one line per backend."""
    sps = sorted({r["sp"] for r in table})
    paths = []
    for name, key, scale, ylabel in (("time", "step_s", 1.0, "step time (s)"),
                                     ("memory", "act_bytes", MiB, "activation MiB per rank")):  # fmt: skip
        panels = [{"title": f"SP={sp}", "ylabel": ylabel, "logx": 2, "lines": [
            ln for label in IMPLS for ln in _results.line(
                [r for r in table if (r["sp"], r["label"]) == (sp, label)],
                lambda r, key=key, scale=scale: r[key] / scale if r[key] else None, label=label)]}
            for sp in sps]  # fmt: skip
        paths.append(_results.line_plots(f"{prefix}-{name}.png", panels, size=(6, 4)))
    return paths


def write(prefix: str, meta: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    table = rows(runs)
    plots = plot(table, prefix) if table else []
    meta["plots"] = [Path(p).name for p in plots]
    return _results.write(prefix, {"meta": meta, "rows": table, "runs": runs}, markdown(meta, table), plots)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sps", default="2,4", help="comma-separated SP sizes (default: 2,4)")
    parser.add_argument("--seq-lens", default="4096", help="comma-separated S (default: 4096)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per run (after 1 warm-up)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--tag", default=None)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--from-json", type=Path)
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        write(str(args.from_json.with_suffix("")), data["meta"], data["runs"])
        return 0
    specs = plan(
        [int(x) for x in args.sps.split(",")], [int(x) for x in args.seq_lens.split(",")], args.repeats, args.steps
    )
    session = _harness.Session("python -m benchmarks.backends", argv, Path(tempfile.mkdtemp(prefix="bench-backends-")))
    runs = []
    for spec in specs:
        record = launch(session, spec, args.timeout)
        if record["status"] == "ok":
            record["bytes"] = measured_bytes(record["result"], spec["label"], spec["warmup"])
        runs.append(record)
    meta = session.finish(failure)
    meta.update(
        steps=args.steps,
        model="tiny Llama, 2 layers, hidden 128, 4 query / 4 kv heads of 32, vocab 2048, fp32, sdpa, ZeRO-1",
    )
    write(str(args.out_dir / (args.tag or f"{meta['date']}-backends-cpu")), meta, runs)
    return 0 if meta["runs_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""SP backends side by side: Ulysses, ring (pass-KV and all-gather-KV), hybrid and upstream DeepSpeed SP.

    python -m benchmarks.backends                          # reduced CPU grid (P = 2, 4; S = 4K; 1 repeat)
    python -m benchmarks.backends --seq-lens 4096,8192,16384 --repeats 2    # the full grid (quiet machine)
    python -m benchmarks.backends --from-json benchmarks/results/<date>-backends-cpu.json   # re-render

`benchmarks.run`'s specs with `IMPLS`' `sp_options`; bytes per step against `hf_longctx.attention.cost` (`theory`,
`measured_bytes`). Method: benchmarks/README.md ("SP backends side by side").
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks import _harness, _results, report
from benchmarks._results import MiB, col
from benchmarks.run import PROFILES, launch, make_spec
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
    m, sp, seq, label = spec["model"], spec["sp"], spec["seq_len"], spec["label"]
    elem, options = report.ELEM_BYTES[spec["dtype"]], IMPLS[label][1]
    args = (m["heads"], m["kv_heads"], m["head_dim"], seq)
    if label in ("ulysses", "upstream"):
        per_layer: Bytes = ulysses_bytes(*args, sp, sp, elem)
    elif label.startswith("ring"):
        per_layer = ring_bytes(m["kv_heads"], m["head_dim"], seq, sp, elem, 4, options["ring_variant"])
    else:
        per_layer = hybrid_bytes(*args, sp, options["ulysses_degree"], elem, 4, options["ring_variant"])
    return m["layers"] * per_layer.total


def measured_bytes(result: dict[str, Any], label: str, warmup: int) -> float:
    """Mean over ranks of the median bytes per measured step that the backend's own exchanges sent."""
    ops = RING_OPS + (("all_to_all",) if label == "hybrid" else ())

    def sent(step: dict[str, Any]) -> float:
        ours = sum(step["hf_ops"].get(op, [0, 0, 0])[1] for op in ops)
        return step["a2a_bytes"] if label in ("ulysses", "upstream") else ours

    return statistics.fmean(statistics.median(sent(s) for s in r["steps"][warmup:]) for r in result["ranks"])


def rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (P, S, label): medians over repeats and the ratios the README quotes."""
    base = {r["spec"]["seq_len"]: r["summary"] for r in runs if r["status"] == "ok" and r["spec"]["label"] == "sp1"}
    sp_runs = [r for r in runs if r["spec"]["label"] != "sp1"]
    theories = {(r["spec"]["sp"], r["spec"]["seq_len"], r["spec"]["label"]): theory(r["spec"]) for r in sp_runs}
    out = _harness.medians(
        sp_runs,
        lambda r: {**{k: r["summary"][k] for k in ("step_s", "act_bytes", "process_peak_bytes")}, "bytes": r["bytes"]},
        base="ulysses", key=lambda s: ((s["sp"], s["seq_len"]), s["label"]),
    )  # fmt: skip
    for row in out:
        (sp, seq), label = row["cell"], row["variant"]
        want, sp1 = theories[(sp, seq, label)], base.get(seq, {})
        row.update(sp=sp, seq_len=seq, label=label, repeats=row["runs"], theory=want, sp1_step_s=sp1.get("step_s"))
        row.update(bytes_vs_theory=_harness.ratio(row["bytes"], want), step_vs_ulysses=row["x_step_s"])
        row["act_vs_sp1"] = _harness.ratio(row["act_bytes"], sp1.get("act_bytes"))
    return sorted(out, key=lambda r: (r["sp"], r["seq_len"], list(IMPLS).index(r["label"])))


COLUMNS: list[_results.Column] = [
    ("SP", lambda r: str(r["sp"])), ("S", lambda r: _results.seq(r["seq_len"])), ("backend", lambda r: r["label"]),
    col("step s", "step_s"), col("vs Ulysses", "step_vs_ulysses", ".3f"), col("SP=1 step s", "sp1_step_s"),
    col("act MiB/rank", "act_bytes", ".0f", MiB), col("act / SP=1", "act_vs_sp1", ".3f"),
    col("MiB sent/step", "bytes", ".2f", MiB), col("theory MiB", "theory", ".2f", MiB),
    col("measured / theory", "bytes_vs_theory", ".3f"),
]  # fmt: skip


def markdown(meta: dict[str, Any], table: list[dict[str, Any]]) -> str:
    model = f"Model: {meta['model']}. Medians of {meta['steps']} measured steps per run."
    return _results.page(
        f"SP backends on the `cpu` profile ({meta['date']})", meta, model, _results.table(COLUMNS, table)
    )


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
    parser = _harness.options(__doc__, "backends-cpu", timeout=600, repeats=1, steps=2)
    parser.add_argument("--sps", default="2,4", help="comma-separated SP sizes (default: 2,4)")
    parser.add_argument("--seq-lens", default="4096", help="comma-separated S (default: 4096)")
    parser.add_argument("--from-json", type=Path)
    args = parser.parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        write(args.out or str(args.from_json.with_suffix("")), data["meta"], data["runs"])
        return 0
    sps, seq_lens = ([int(x) for x in a.split(",")] for a in (args.sps, args.seq_lens))
    session = _harness.Session("backends", argv)
    runs = []
    for spec in plan(sps, seq_lens, args.repeats, args.steps):
        record = launch(session, spec, args.timeout)
        if record["status"] == "ok":
            record["bytes"] = measured_bytes(record["result"], spec["label"], spec["warmup"])
        runs.append(record)
    meta = session.finish()
    meta.update(
        steps=args.steps,
        model="tiny Llama, 2 layers, hidden 128, 4 query / 4 kv heads of 32, vocab 2048, fp32, sdpa, ZeRO-1",
    )
    write(_harness.out(args), meta, runs)
    return 0 if meta["runs_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

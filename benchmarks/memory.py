"""Memory benchmark (CPU): hf_longctx with and without its memory flags vs the upstream DeepSpeed SP path.

    python -m benchmarks.memory                 # the full CPU benchmark, SP=2 (about 40 min on a quiet 2-core box)
    python -m benchmarks.memory --quick         # smoke: S=2K, one repeat, short ladder (a few minutes)
    python -m benchmarks.memory --from-json benchmarks/results/<date>-memory.json   # re-render only

Every run is one `benchmarks._harness` job of 2 ranks running `benchmarks.worker.run` (DeepSpeed ZeRO-1, gloo, fp32,
sdpa, one thread per process). The sections (`flags`: the flags on vs off vs upstream through `Trainer` and
`SFTTrainer`; `packed`: packed rows and their per-document reference loss; `longest`: the longest row within
`--budget-gib`), the model and the aggregation are described in benchmarks/README.md ("Memory flags"). Writes
`benchmarks/results/<date>-memory.{json,md}` and `-memory-peak.png`, `-memory-time.png`, `-memory-longest.png`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks import _harness, _results
from benchmarks._harness import ratio, slowest_rank_median
from benchmarks._results import GiB, col

K = 1024
MODEL = {"arch": "llama", "hidden": 256, "intermediate": 1024, "layers": 2, "heads": 8, "kv_heads": 2, "head_dim": 32}
FLAGS = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
# variant -> (implementation, memory flags, activation checkpointing)
VARIANTS = {
    "off": ("hf_longctx", {}, False),
    "ckpt": ("hf_longctx", {}, True),
    "flags": ("hf_longctx", FLAGS, False),
    "loss": ("hf_longctx", {"tiled_loss": True}, False),
    "upstream": ("upstream", {}, False),
}
SECTIONS = ("flags", "packed", "longest")
# Cells: the trainer of section `flags`, "packed" (section `packed`, stock Trainer) and "longest" (the ladder).
ORDER = {"flags": ("off", "ckpt", "flags", "upstream"), "packed": ("off", "loss", "flags", "upstream")}
TARGETS = {
    "peak_flags_over_upstream": 0.35,  # <=
    "time_flags_over_off": 1.1,  # <=
    "time_flags_over_ckpt": 1.1,  # <= (not an issue target: the same bound against checkpointing alone)
    "longest_ours_over_upstream": 4.0,  # >=
    "packed_time_over_upstream": 0.5,  # <=
    "packed_peak_over_upstream": 1.0,  # <=
}


def spec(variant: str, trainer: str, seq_len: int, vocab: int, steps: int, warmup: int, **extra: Any) -> dict:
    """A `benchmarks.worker` spec: `steps` measured steps after `warmup` ones."""
    impl, flags, checkpointing = VARIANTS[variant]
    model = dict(MODEL, vocab=vocab, max_positions=max(seq_len, 4096))
    base = {"impl": impl, "sp_options": flags, "gradient_checkpointing": checkpointing, "trainer": trainer, "sp": 2}
    base.update(seq_len=seq_len, warmup=warmup, steps=warmup + steps, log=True, attn="sdpa", dtype="fp32")
    return {**base, "data": "random", "threads": 1, "model": model, **extra}


def numbers(record: dict[str, Any]) -> dict[str, Any]:
    """Step time (wall and process CPU, s), peak (GiB) and first loss of one ok run."""
    ranks, warmup = record["result"]["ranks"], record["spec"]["warmup"]
    return {
        "step_s": slowest_rank_median(ranks, "step_s", warmup),
        "cpu_s": slowest_rank_median(ranks, "cpu_s", warmup),
        "peak_gib": _harness.worst(record, "process_peak_bytes") / GiB,
        "first_loss": ranks[0]["first_loss"],
        "reference_loss": record["result"].get("document_reference_loss", ranks[0].get("document_reference_loss")),
    }


def run_all(args: Any, session: _harness.Session) -> None:
    def launch(cell: str, variant: str) -> dict[str, Any]:
        packed = {"data": "packed", "doc_len": args.doc_len, "reference_loss": True} if cell == "packed" else {}
        trainer, vocab = ("trainer", K) if packed else (cell, 32 * K)
        job = spec(variant, trainer, args.seq_len, vocab, args.steps, 1, **packed)
        return {"target": "benchmarks.worker:run", "nproc": 2, "env": _harness.CPU_ENV, "spec": job}

    flags, packed = ("flags" in args.sections) * args.trainers, ["packed"] * ("packed" in args.sections)
    session.alternate(flags, ORDER["flags"], args.repeats, args.timeout, launch)
    session.alternate(packed, ORDER["packed"], args.repeats, args.timeout, launch)
    if "longest" not in args.sections:
        return

    def fits(variant: str, length: int) -> bool:  # one optimizer step, no warm-up (a step that fits once fits)
        job = dict(spec(variant, "trainer", length, 32 * K, 1, 0), cell="longest", variant=variant)
        record = session.run(job, f"longest {variant} S={length}", "benchmarks.worker:run", 2, args.timeout,
                             env=_harness.CPU_ENV, spec=job)  # fmt: skip
        return record["status"] == "ok" and numbers(record)["peak_gib"] <= args.budget_gib

    longest_up = 0
    for length in args.ladder:
        if not fits("upstream", length):
            break
        longest_up = length
    length = 4 * max(longest_up, args.ladder[0])
    while length <= args.max_seq and fits("flags", length):
        length *= 2


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Cells of sections 1 and 2 (median over repeats), the section-3 ladder and every target ratio."""
    records, budget = data["records"], data["meta"]["args"]["budget_gib"]
    for r in records:  # results written before the cells had names
        old = r["spec"].get("section")
        r["spec"].setdefault("cell", r["spec"].get("trainer") if old == "flags" else old)
    rows = _harness.medians([r for r in records if r["spec"]["cell"] != "longest"], numbers)
    ladder = [{"variant": r["spec"]["variant"], "seq_len": r["spec"]["seq_len"], "status": r["status"],
               "peak_gib": numbers(r)["peak_gib"] if r["status"] == "ok" else None}
              for r in records if r["spec"]["cell"] == "longest"]  # fmt: skip
    for r in ladder:
        r["fits"] = r["peak_gib"] is not None and r["peak_gib"] <= budget

    def get(cell: str, variant: str, key: str) -> float | None:
        return next((r[key] for r in rows if (r["cell"], r["variant"]) == (cell, variant)), None)

    def rel(cell: str, variant: str, base: str, key: str) -> float | None:
        return ratio(get(cell, variant, key), get(cell, base, key))

    ratios = {}
    for trainer in ("trainer", "sft"):
        ratios[f"{trainer}_peak_flags_over_upstream"] = rel(trainer, "flags", "upstream", "peak_gib")
        for key, name in (("step_s", "time"), ("cpu_s", "cpu_time")):
            for base in ("off", "ckpt"):
                ratios[f"{trainer}_{name}_flags_over_{base}"] = rel(trainer, "flags", base, key)
    for variant, tag in (("off", "packed"), ("loss", "packed_tiled_loss"), ("flags", "packed_flags")):
        for key, name in (("step_s", "time"), ("cpu_s", "cpu_time"), ("peak_gib", "peak")):
            ratios[f"{tag}_{name}_over_upstream"] = rel("packed", variant, "upstream", key)
    longest = {v: max([r["seq_len"] for r in ladder if r["variant"] == v and r["fits"]], default=None)
               for v in ("upstream", "flags")}  # fmt: skip
    ratios["longest_ours_over_upstream"] = ratio(longest["flags"], longest["upstream"])
    failures = [f"{r.get('label', r['spec']['cell'])}: {r['status']}" for r in records if r["status"] != "ok"]
    return {"rows": rows, "ladder": ladder, "longest": longest, "ratios": ratios, "failures": failures}


def _verdict(name: str, value: float) -> str:
    key = name.removeprefix("trainer_").removeprefix("sft_").replace("cpu_time", "time")
    key = key.replace("packed_flags_", "packed_").replace("packed_tiled_loss_", "packed_")
    return f"{value:.4f} (target {_results.target(value, TARGETS[key], key == 'longest_ours_over_upstream')})"


_NAMES = {"off": "hf_longctx", "loss": "hf_longctx, tiled_loss", "flags": "hf_longctx, flags"}
_COMMON: list[_results.Column] = [col("peak GiB / rank", "peak_gib", ".3f"), col("step s (wall)", "step_s"),
                                  col("step s (CPU)", "cpu_s")]  # fmt: skip
FLAG_COLUMNS = [("trainer", lambda c: c["cell"]), ("variant", lambda c: c["variant"]), *_COMMON,
                ("runs", lambda c: str(c["runs"]))]  # fmt: skip
PACKED_COLUMNS = [("variant", lambda c: _NAMES.get(c["variant"], c["variant"])), *_COMMON,
                  col("first-step loss", "first_loss", ".6f"),
                  col("per-document reference loss", "reference_loss", ".6f")]  # fmt: skip
LADDER_COLUMNS = [("variant", lambda r: r["variant"]), ("S", lambda r: str(r["seq_len"])),
                  col("peak GiB / rank", "peak_gib", ".3f"),
                  ("fits", lambda r: "yes" if r["fits"] else "no")]  # fmt: skip


def render_markdown(meta: dict[str, Any], summary: dict[str, Any]) -> str:
    args, rows = meta["args"], summary["rows"]
    intro = (" (Other jobs shared the machine when the load exceeds the CPU count.) Tiny Llama "
             f"{meta['model']}, SP=2 (2 processes, one thread each), DeepSpeed ZeRO-1, fp32, sdpa. Flags: "
             f"{', '.join(meta['flags'])}; ckpt = activation checkpointing only.")  # fmt: skip
    blocks = [f"## Flags on vs off vs upstream: S = {args['seq_len']}, vocabulary 32,768",
              _results.table(FLAG_COLUMNS, [r for r in rows if r["cell"] != "packed"])]  # fmt: skip
    packed = [r for r in rows if r["cell"] == "packed"]
    if packed:
        docs = f"{args['seq_len'] // args['doc_len']} documents x {args['doc_len']} tokens"
        blocks += [f"## Packed rows: {docs}, vocabulary 1,024", _results.table(PACKED_COLUMNS, packed)]
    if summary["ladder"]:
        budget, longest = args["budget_gib"], summary["longest"]
        blocks += [f"## Longest row that trains one step within {budget} GiB per rank (vocabulary 32,768)",
                   _results.table(LADDER_COLUMNS, summary["ladder"]),
                   f"Longest: upstream {longest['upstream']}, hf_longctx with flags {longest['flags']}\n"
                   f"(hf_longctx tried up to {args['max_seq']})."]  # fmt: skip
    verdicts = [f"- {name}: {_verdict(name, value)}" for name, value in summary["ratios"].items() if value is not None]
    blocks += ["## Targets", "Time ratios are given on wall time and on process CPU time (the robust one on a shared "
               "machine).", verdicts]  # fmt: skip
    if summary["failures"]:
        blocks.append("Failed runs: " + "; ".join(summary["failures"]))
    return _results.page(f"Memory benchmark, CPU ({meta['date']})", None, _results.run_line(meta) + intro, *blocks)


PALETTE = {"off": "tab:blue", "ckpt": "tab:cyan", "loss": "tab:olive", "flags": "tab:green", "upstream": "tab:red"}


def plot(summary: dict[str, Any], prefix: str) -> list[str]:
    """Bar charts of peak and step time per trainer/variant (and packed rows), and the section-3 ladder."""
    paths = []
    for key, label, name in (("peak_gib", "peak resident GiB per rank", "peak"), ("step_s", "step time (s)", "time")):
        items, gaps = [], set()
        for cell in ("trainer", "sft", "packed"):
            items += [(f"{cell}\n{r['variant']}", r[key], PALETTE[r["variant"]]) for r in summary["rows"]
                      if r["cell"] == cell and r[key] is not None]  # fmt: skip
            gaps.add(len(items) - 1)
        title = f"hf_longctx (off / flags) vs upstream DeepSpeed SP, SP=2: {label}"
        paths.append(_results.bars(f"{prefix}-{name}.png", title, label, items, gaps))
    if not (ladder := summary["ladder"]):
        return paths
    lines = [ln for v in ("upstream", "flags") for ln in _results.line(
        [r for r in ladder if r["variant"] == v], lambda r: r["peak_gib"], label=v, color=PALETTE[v])]  # fmt: skip
    panel = {"title": "one optimizer step: peak memory vs length", "xlabel": "sequence length (tokens, SP=2)",
             "ylabel": "peak resident GiB per rank", "lines": lines, "logx": 2}  # fmt: skip
    return paths + [_results.line_plots(f"{prefix}-longest.png", [panel], size=(6, 4))]


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "memory", timeout=1800, repeats=2, steps=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: S=2K, 1 repeat, 1 measured step")
    parser.add_argument("--seq-len", type=int, default=16 * K)
    parser.add_argument("--doc-len", type=int, default=K)
    parser.add_argument("--budget-gib", type=float, default=2.5, help="peak resident memory per rank (section 3)")
    parser.add_argument("--ladder", default="4096,6144,8192,12288,16384", help="upstream lengths (section 3)")
    parser.add_argument("--max-seq", type=int, default=64 * K, help="longest hf_longctx length tried (section 3)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of flags,packed,longest")
    parser.add_argument("--trainers", default="trainer,sft", help="section 1: trainer, sft or both")
    parser.add_argument("--from-json", help="re-render the tables and plots of a saved run")
    args = parser.parse_args(argv)
    args.ladder = [int(x) for x in str(args.ladder).split(",")]
    args.sections, args.trainers = ([x for x in a.split(",") if x] for a in (args.sections, args.trainers))
    unknown = sorted(set(args.sections) - set(SECTIONS)) + sorted(set(args.trainers) - {"trainer", "sft"})
    if unknown:
        parser.error(f"unknown sections / trainers: {unknown}")
    if args.quick:
        args.seq_len, args.doc_len, args.repeats, args.steps = 2 * K, 256, 1, 1
        args.ladder, args.max_seq = [1024, 2048], 8 * K
    prefix = _harness.out(args)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        meta = data["meta"]  # results written before the shared harness: its header fields from the old ones
        if "argv" in meta:
            meta.update(command=" ".join(["python -m benchmarks.memory", *meta["argv"]]), total_wall_s=meta["wall_s"],
                        load_start=meta["load_average_start"], load_end=meta["load_average_end"])  # fmt: skip
        prefix = args.out or str(args.from_json).removesuffix(".json")
    else:
        session = _harness.Session("memory", argv)
        run_all(args, session)
        meta = session.finish()
        meta.update(args={k: v for k, v in vars(args).items() if k != "from_json"}, model=MODEL, flags=FLAGS)
        data = {"meta": meta, "records": session.records}
    data["summary"] = summary = summarize(data)
    _results.write(prefix, data, render_markdown(data["meta"], summary), plot(summary, prefix))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Memory benchmark (CPU): hf_longctx with and without its memory flags vs the upstream DeepSpeed SP path.

    python -m benchmarks.memory                 # the full CPU benchmark, SP=2 (about 40 min on a quiet 2-core box)
    python -m benchmarks.memory --quick         # smoke: S=2K, one repeat, short ladder (a few minutes)
    python -m benchmarks.memory --from-json benchmarks/results/<date>-memory.json   # re-render only

Every run is one `benchmarks._harness` job of 2 ranks running `benchmarks.worker.run` (DeepSpeed ZeRO-1,
gloo, fp32, sdpa, one thread per process), with a timeout; a failed run is recorded and the rest continue.
Sections (tiny Llama: hidden 256, 2 layers, 8 query / 2 key-value heads of 32, MLP 1024):

1. `flags`: one row of 16,384 random tokens, vocabulary 32,768, SP=2, through the stock `Trainer` and TRL's
   `SFTTrainer`: hf_longctx without flags ("off"), with activation checkpointing only ("ckpt": the on-device
   version of what `offload_activations` does), with all three flags, and upstream. Repeats reverse the order
   of the variants (A B C D, D C B A, ...). Peak resident memory per rank (the process high-water mark, worst
   rank) and step time (median over measured steps and repeats).
2. `packed`: rows of 16 documents x 1,024 tokens (positions restart), vocabulary 1,024 (so attention, not the
   loss, dominates), `Trainer`, hf_longctx (per-document attention) without flags, with `tiled_loss` only
   ("loss") and with the three flags vs upstream; the first step's loss of each against the per-document
   reference (each document alone, same weights).
3. `longest`: the longest row that trains one optimizer step at SP=2 with every rank's peak resident memory
   within `--budget-gib` (vocabulary 32,768): upstream on a ladder of lengths, hf_longctx with the flags from
   4x upstream's longest upward, doubling, up to `--max-seq`.

Writes `benchmarks/results/<date>-memory.{json,md}` and `-memory-peak.png`, `-memory-time.png`,
`-memory-longest.png`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import _harness, _results
from benchmarks.memory_report import plot, render_markdown, summarize

RESULTS = _results.RESULTS
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


def spec(variant: str, trainer: str, seq_len: int, vocab: int, steps: int, warmup: int, **extra: Any) -> dict:
    """A `benchmarks.worker` spec (plus the section's labels): `steps` counts the warm-up."""
    impl, flags, checkpointing = VARIANTS[variant]
    model = dict(MODEL, vocab=vocab, max_positions=max(seq_len, 4096))
    base = {"variant": variant, "impl": impl, "sp_options": flags, "gradient_checkpointing": checkpointing}
    base.update(trainer=trainer, sp=2, seq_len=seq_len, warmup=warmup, steps=warmup + steps, log=True)
    base.update(attn="sdpa", dtype="fp32", data="random", threads=1, model=model)
    return {**base, **extra}


def _peak(record: dict[str, Any]) -> float | None:
    if record["status"] != "ok":
        return None
    return max(r["process_peak_bytes"] for r in record["result"]["ranks"]) / 2**30


def run_all(args: argparse.Namespace, session: _harness.Session) -> list[dict[str, Any]]:
    def go(job: dict[str, Any]) -> dict[str, Any]:
        label = f"{job['section']} {job['variant']} {job['trainer']} S={job['seq_len']}"
        worker_spec = {k: v for k, v in job.items() if k not in ("variant", "section", "rep")}
        return session.run(
            job, label, "benchmarks.worker:run", job["sp"], args.timeout, env=_harness.CPU_ENV, spec=worker_spec
        )

    seq, steps, warmup = args.seq_len, args.steps, 1
    order = ["off", "ckpt", "flags", "upstream"]
    for rep in range(args.repeats if "flags" in args.sections else 0):  # section 1: order reversed every repeat
        for trainer in args.trainers:
            for variant in order if rep % 2 == 0 else order[::-1]:
                go(dict(spec(variant, trainer, seq, 32 * K, steps, warmup), section="flags", rep=rep))
    packed_order = ["off", "loss", "flags", "upstream"]
    for rep in range(args.repeats if "packed" in args.sections else 0):  # section 2
        for variant in packed_order if rep % 2 == 0 else packed_order[::-1]:
            extra = {"data": "packed", "doc_len": args.doc_len, "reference_loss": True}
            go(dict(spec(variant, "trainer", seq, K, steps, warmup, **extra), section="packed", rep=rep))
    if "longest" not in args.sections:
        return session.records
    # section 3: one optimizer step per length, no warm-up (a step that fits once fits)
    longest_up = 0
    for length in args.ladder:
        record = go(dict(spec("upstream", "trainer", length, 32 * K, 1, 0), section="longest"))
        peak = _peak(record)
        if peak is None or peak > args.budget_gib:
            break
        longest_up = length
    length = 4 * max(longest_up, args.ladder[0])
    while length <= args.max_seq:
        record = go(dict(spec("flags", "trainer", length, 32 * K, 1, 0), section="longest"))
        peak = _peak(record)
        if peak is None or peak > args.budget_gib:
            break
        length *= 2
    return session.records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: S=2K, 1 repeat, 1 measured step")
    parser.add_argument("--seq-len", type=int, default=16 * K)
    parser.add_argument("--doc-len", type=int, default=K)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per run (after 1 warm-up step)")
    parser.add_argument("--budget-gib", type=float, default=2.5, help="peak resident memory per rank (section 3)")
    parser.add_argument("--ladder", default="4096,6144,8192,12288,16384", help="upstream lengths (section 3)")
    parser.add_argument("--max-seq", type=int, default=64 * K, help="longest hf_longctx length tried (section 3)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of flags,packed,longest")
    parser.add_argument("--trainers", default="trainer,sft", help="section 1: trainer, sft or both")
    parser.add_argument("--from-json", help="re-render the tables and plots of a saved run")
    parser.add_argument("--out-prefix", help="results path prefix (default benchmarks/results/<date>-memory)")
    args = parser.parse_args(argv)
    args.ladder = [int(x) for x in str(args.ladder).split(",")]
    args.sections = [x for x in args.sections.split(",") if x]
    args.trainers = [x for x in args.trainers.split(",") if x]
    unknown = sorted(set(args.sections) - set(SECTIONS)) + sorted(set(args.trainers) - {"trainer", "sft"})
    if unknown:
        parser.error(f"unknown sections / trainers: {unknown}")
    if args.quick:
        args.seq_len, args.doc_len, args.repeats, args.steps = 2 * K, 256, 1, 1
        args.ladder, args.max_seq = [1024, 2048], 8 * K
    prefix = Path(args.out_prefix or RESULTS / f"{datetime.date.today().isoformat()}-memory")
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        meta = data["meta"]  # results written before the shared harness: its header fields from the old ones
        if "argv" in meta:
            meta.update(command=" ".join(["python -m benchmarks.memory", *meta["argv"]]), total_wall_s=meta["wall_s"],
                        load_start=meta["load_average_start"], load_end=meta["load_average_end"])  # fmt: skip
        prefix = Path(args.out_prefix or str(args.from_json).removesuffix(".json"))
    else:
        session = _harness.Session("python -m benchmarks.memory", argv, Path(tempfile.mkdtemp(prefix="bench-memory-")))
        records = run_all(args, session)
        meta = session.finish(lambda r: f"{r['spec']['section']} {r['spec']['variant']} S={r['spec']['seq_len']}")
        args_meta = {k: v for k, v in vars(args).items() if k != "from_json"}
        meta.update(args=args_meta, model=MODEL, flags=FLAGS)
        data = {"meta": meta, "records": records}
    summary = summarize(data)
    _results.write(prefix, data, render_markdown(data["meta"], summary), plot(summary, str(prefix)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The harness every benchmark shares: `job` (torchrun of `module:function` in N ranks, with a timeout that kills
every rank; `main` is the ranks' side: `function(rank, world_size, **kwargs)`, results gathered to rank 0),
`Session` (a benchmark's jobs, progress lines and metadata; `alternate`: every variant of every cell in A B / B A
order), `medians` (aggregation), `compare` (a whole comparison) and `options` / `out` (the shared flags).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import _results

ROOT = Path(__file__).resolve().parent.parent
# A fixed mmap threshold turns off glibc's dynamic one: freed tensors go back to the OS, so resident memory
# follows the live tensors (see benchmarks/README.md).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# CPU jobs: one thread per rank (ranks share the cores), gloo on the loopback (and glibc's threshold fixed).
THREAD_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
CPU_ENV = {**THREAD_ENV, **MALLOC_ENV}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def worst(record: dict[str, Any], key: str) -> Any:
    """The largest `key` over the ranks of an ok job's record (the worst rank's peak, bytes, ...)."""
    return max(r[key] for r in record["result"]["ranks"])


def slowest_rank_median(ranks: list[dict[str, Any]], key: str, warmup: int) -> float | None:
    """Median over measured steps of the slowest rank's `key` (a step ends when its slowest rank ends)."""
    n = min(len(r["steps"]) for r in ranks)
    return median(max(r["steps"][i][key] for r in ranks) for i in range(warmup, n))


def job(
    target: str, nproc: int, timeout: float, log_dir: Path, name: str, env: dict[str, str] | None = None, **kwargs: Any
) -> dict[str, Any]:
    """Run `target` ("module:function") in `nproc` ranks under torchrun; the record of the job."""
    out, log = log_dir / f"{name}.json", log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    cmd += ["-m", "benchmarks._harness", "--call", target, "--kwargs", json.dumps(kwargs), "--out", str(out)]
    full_env = {**os.environ, **OFFLINE_ENV, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    record: dict[str, Any] = {"launched_at": time.time()}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        # A new session, so a timeout can kill torchrun and every rank it started (its process group).
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    record.update(wall_s=time.perf_counter() - t0, ended_at=time.time())
    if rc == 0 and out.exists():
        record.update(status="ok", result=json.loads(out.read_text()))
    else:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        oom = any("out of memory" in line.lower() for line in tail)
        status = "timeout" if rc is None else ("oom" if oom else "failed")
        record.update(status=status, error=f"rc={rc}: " + " | ".join(line.strip() for line in tail))
    return record


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def options(doc: str, name: str, timeout: float, **defaults: int) -> argparse.ArgumentParser:
    """The parser of a benchmark `name`, with the flags they share: `--timeout` (seconds per job), `--out PREFIX`
    (default `benchmarks/results/<date>-<name>`, read by `out`) and each of `repeats` / `steps` given a default."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per job")
    parser.add_argument("--out", help=f"results path prefix (default benchmarks/results/<date>-{name})")
    helps = {"repeats": "runs per variant and cell", "steps": "measured steps per run (after 1 warm-up)"}
    for key, value in defaults.items():
        parser.add_argument(f"--{key}", type=int, default=value, help=helps[key])
    parser.set_defaults(name=name)
    return parser


def out(args: argparse.Namespace) -> str:
    """The results prefix of a parsed `options` command line."""
    return args.out or str(_results.RESULTS / f"{datetime.date.today().isoformat()}-{args.name}")


class Session:
    """One benchmark invocation: its jobs, their logs, and the metadata every results file starts with."""

    def __init__(self, name: str, argv: list[str] | None, log_dir: Path | None = None) -> None:
        args = argv if argv is not None else sys.argv[1:]
        self.meta: dict[str, Any] = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count()}
        self.meta.update(command=" ".join([f"python -m benchmarks.{name}", *map(shlex.quote, args)]), load_start=load())
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
        self.records: list[dict[str, Any]] = []
        self._t0 = time.perf_counter()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        print(f"logs in {self.log_dir}", flush=True)

    def run(self, stored: dict[str, Any], label: str, target: str, nproc: int, timeout: float, **kw: Any) -> dict:
        """Run one job with `target`'s keyword arguments `kw` (and `env`); `stored` is its record's spec."""
        name = f"job{len(self.records):03d}"
        record = {"spec": stored, "label": label, **job(target, nproc, timeout, self.log_dir, name, **kw)}
        self.records.append(record)
        elapsed = time.perf_counter() - self._t0
        tail = "" if record["status"] == "ok" else "  " + record.get("error", "")[:300]
        print(f"[{len(self.records):3d} {elapsed:6.0f}s] {label}: {record['status']} in {record['wall_s']:.0f}s{tail}")
        return record

    def alternate(self, cells: Iterable[Any], variants: Sequence[str], repeats: int, timeout: float,
                  launch: Callable[[Any, str], dict[str, Any]]) -> None:  # fmt: skip
        """Run every (cell, variant) `repeats` times, the variants' order reversed on every repeat (A B, B A, ...:
        linear drift cancels within a cell). `launch(cell, variant)` gives the job: `target`, `nproc` and the
        target's keyword arguments (`env`, `init_backend` included); its spec records `cell` and `variant`."""
        for cell in cells:
            for rep in range(repeats):
                for variant in variants[:: 1 if rep % 2 == 0 else -1]:
                    kw = launch(cell, variant)
                    extra = kw.get("spec") or {k: v for k, v in kw.items() if k not in ("env", "target", "nproc")}
                    stored = {"cell": cell, "variant": variant, "rep": rep, **extra}
                    self.run(stored, f"{variant} {cell}", kw.pop("target"), kw.pop("nproc"), timeout, **kw)

    def finish(self, failure: Callable[[dict[str, Any]], str] | None = None) -> dict[str, Any]:
        ok = sum(r["status"] == "ok" for r in self.records)
        self.meta.update(total_wall_s=time.perf_counter() - self._t0, load_end=load())
        self.meta.update(runs_ok=ok, runs_failed=len(self.records) - ok)
        name = failure or (lambda r: r["label"])
        self.meta["failures"] = [f"{name(r)}: {r['status']} {r.get('error', '')[:400]}" for r in self.records
                                 if r["status"] != "ok"]  # fmt: skip
        return self.meta


def medians(records: Iterable[dict[str, Any]], numbers: Callable[[dict[str, Any]], dict[str, Any]],
            base: str | None = None, key: Callable[[dict[str, Any]], tuple] | None = None) -> list[dict]:  # fmt: skip
    """One row per (cell, variant) of `Session.alternate`'s ok records (`key(spec)` for other specs), in their first
    order: `{"cell", "variant", "runs", **the median over repeats of numbers(record)}`; with `base`, also
    `x_<key>`: the ratio to the `base` variant of the same cell."""
    runs: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for r in records:
        if r["status"] == "ok":
            cell = key(r["spec"]) if key else (r["spec"]["cell"], r["spec"]["variant"])
            runs.setdefault(cell, []).append(numbers(r))
    rows = {key: {"cell": key[0], "variant": key[1], "runs": len(group),
                  **{k: median(g[k] for g in group) for k in group[0]}} for key, group in runs.items()}  # fmt: skip
    for (cell, _), row in rows.items():
        ref = rows.get((cell, base), {})
        row.update({f"x_{k}": ratio(row[k], ref.get(k)) for k in runs[(cell, row["variant"])][0]} if base else {})
    return list(rows.values())


def compare(args: argparse.Namespace, argv: list[str] | None, cells: Iterable[Any], variants: Sequence[str],
            launch: Callable[[Any, str], dict[str, Any]], numbers: Callable[[dict[str, Any]], dict[str, Any]],
            columns: list[Any], title: str, text: str | Callable[[list[dict]], str],
            target: tuple[str, str, float] | None = None) -> int:  # fmt: skip
    """A whole comparison of an `options` benchmark: `Session.alternate` over `cells` x `variants`, `medians`
    against the first variant, one page (`text`, then the table: S, variant, `columns`) in `<out>.{json,md}`; 0 when
    `target` = (variant, key, limit) holds (key <= limit in every cell), or, without one, when every run ended ok."""
    session = Session(args.name.replace("-", "_"), argv)
    session.alternate(cells, variants, args.repeats, args.timeout, launch)
    meta, rows = session.finish(), medians(session.records, numbers, base=variants[0])
    columns = [("S", lambda r: _results.seq(r["cell"])), ("run", lambda r: r["variant"]), *columns]
    text = (text(rows) if rows else "") if callable(text) else text
    page = _results.page(f"{title} ({meta['date']})", meta, text, _results.table(columns, rows))
    _results.write(out(args), {"meta": meta, "rows": rows, "runs": session.records}, page if rows else "no runs\n")
    if target is None:
        return 0 if rows and not meta["failures"] else 1
    values = [r[target[1]] for r in rows if r["variant"] == target[0]]
    return 0 if values and all(v is not None and v <= target[2] for v in values) else 1


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "hf_longctx"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "?"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one benchmark job's ranks (launched by benchmarks._harness.job)")
    parser.add_argument("--call", required=True, help="module:function, called as fn(rank, world_size, **kwargs)")
    parser.add_argument("--kwargs", default="{}")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    kwargs = json.loads(args.kwargs)
    backend = kwargs.pop("init_backend", None)
    if backend:
        dist.init_process_group(backend)
    module, function = args.call.split(":")
    t0 = time.perf_counter()
    result = getattr(importlib.import_module(module), function)(rank, world, **kwargs)
    ranks = [result]
    if dist.is_initialized() and world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, result)
    if rank == 0:
        out = {"world_size": world, "ranks": ranks, "versions": versions(), "worker_s": time.perf_counter() - t0}
        Path(args.out + ".tmp").write_text(json.dumps(out))
        os.replace(args.out + ".tmp", args.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown (atexit hooks and GC of torch/transformers/DeepSpeed: ~3 s per process on
    # the 2-core box); the result file is complete and closed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

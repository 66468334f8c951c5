"""Kernel matrix on one GPU: every attention kernel and SP backend through hf_longctx, bf16 and fp32.

    python -m benchmarks.gpu_check                 # on a CUDA machine (scripts/gpu_check.sh runs it)
    python -m benchmarks.gpu_check --cpu-dry-run   # the same code on CPU (flash and flex rows: expected SKIPs)

One job per (kernel, backend), all jobs at once: Ulysses with sdpa, eager, flex and flash-attn 2 on 2 ranks (SP=1 and
SP=2 cells), ring with the block kernels on 2 ranks, hybrid (Ulysses 2 x ring 2) on 4. The ranks share the one GPU
over gloo (NCCL refuses two ranks on one device; hf_longctx moves each collective's tensors to the host). Each cell
is one training step on a packed row of three documents, compared with the fp32 eager model run document by
document; a leak control shows the comparison sees documents that attend to each other. `matrix` runs the cells,
`verdict` judges them (a SKIP is not a pass); method and tolerances: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import hf_longctx
from benchmarks import _results
from benchmarks._results import RESULTS

DOCS = (37, 50, 41)
VOCAB = 512
# (kernel, SP backend, ranks): the jobs of the matrix.
JOBS = (("sdpa", "ulysses", 2), ("eager", "ulysses", 2), ("flash_attention_2", "ulysses", 2),
        ("flex_attention", "ulysses", 2), ("sdpa", "ring", 2), ("sdpa", "hybrid", 4))  # fmt: skip


def _model(attn: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from benchmarks.worker import build_model

    shape = {"arch": "llama", "vocab": VOCAB, "hidden": 128, "intermediate": 256, "layers": 2, "heads": 4}
    return build_model({**shape, "kv_heads": 2, "head_dim": 32}, attn, "fp32", "cpu").to(device, dtype)


def flash_kernel_module() -> str:
    """The module of the kernel transformers runs for "flash_attention_2" (flash_attn..., or a stand-in)."""
    from transformers import modeling_flash_attention_utils as fa

    return fa._lazy_imports("flash_attention_2")[0].__module__


def _batch(device: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (1, sum(DOCS)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device), "position_ids": pos.to(device)}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}


def plain_step(attn: str, dtype: torch.dtype, device: str, per_document: bool) -> tuple[float, dict]:
    """The model without hf_longctx: each document alone (`per_document`) or the whole row, causal only."""
    from hf_longctx.data.sharding import shard_batch_for_rank

    model = _model(attn, dtype, device)
    full = shard_batch_for_rank(_batch(device), 0, 1)
    ids, shift_labels = full["input_ids"], full["shift_labels"]
    if per_document:
        bounds = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
        logits = torch.cat(
            [model(input_ids=ids[:, a:b]).logits for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=1
        )
    else:
        logits = model(input_ids=ids).logits
    loss = hf_longctx.sequence_parallel_loss(logits.float(), shift_labels, hf_longctx.SequenceParallelGroups.single())
    loss.backward()
    return loss.item(), _grads(model)


def _errors(loss: float, grads: dict, ref: tuple[float, dict]) -> tuple[float, float]:
    ref_loss, ref_grads = ref
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in ref_grads.items())
    return abs(loss - ref_loss) / abs(ref_loss), worst


def sp_step(attn: str, backend: str, dtype: torch.dtype, device: str, groups: Any) -> tuple[float, dict]:
    """One step through hf_longctx on `groups` (single-process groups: SP=1): the loss and full gradients."""
    from hf_longctx.distributed.comm import all_reduce_sum

    model = _model(attn, dtype, device)
    options = {"ulysses_degree": 2} if backend == "hybrid" else {}
    with hf_longctx.enable_sequence_parallel(model, groups, backend=backend, **options):
        shard = hf_longctx.shard_batch(_batch(device), groups)
        shift_labels = shard.pop("shift_labels")
        loss = hf_longctx.sequence_parallel_loss(model(**shard).logits.float(), shift_labels, groups)
        loss.backward()
    world = groups.sp_world_size
    return loss.item(), {n: all_reduce_sum(g, groups.sp_group) / world for n, g in _grads(model).items()}


def _judge(row: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    if dtype == torch.float32:
        ok = row["loss_rel_err"] <= 1e-4 and row["grad_rel_err"] <= 1e-3
    else:  # bf16: SP may add no more than bf16's own error (the model run document by document in bf16)
        ok = all(row[k] <= 2 * row[f"plain_{k}"] + 1e-6 for k in ("loss_rel_err", "grad_rel_err"))
    return {**row, "status": "PASS" if ok else "FAIL"}


def kernel_job(rank: int, world_size: int, attn: str, backend: str, device: str) -> list[dict[str, Any]]:
    """Every cell of one (kernel, backend): fp32 and bf16 (flash: bf16), SP=1 (Ulysses) and SP=world_size."""
    if device == "cuda" and attn == "flash_attention_2" and not flash_kernel_module().startswith("flash_attn"):
        raise RuntimeError(f"flash row refused: flash_attention_2 resolves to {flash_kernel_module()}, not flash_attn")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 cells are compared at fp32 tolerances
    torch.backends.cudnn.allow_tf32 = False
    ref = plain_step("eager", torch.float32, device, per_document=True)
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    rows = []
    if (attn, backend) == ("sdpa", "ulysses"):
        leak = _errors(*plain_step("eager", torch.float32, device, per_document=False), ref)
        rows.append({"kernel": "leak control (whole row, causal only)", "backend": "-", "dtype": "float32", "sp": 1,
                     "loss_rel_err": leak[0], "grad_rel_err": leak[1],
                     "status": "PASS" if leak[1] > 1e-2 else "FAIL"})  # fmt: skip
    for dtype in (torch.bfloat16,) if attn == "flash_attention_2" else (torch.float32, torch.bfloat16):
        plain = _errors(*plain_step(attn, dtype, device, per_document=True), ref)
        for sp_groups in ((hf_longctx.SequenceParallelGroups.single(),) if backend == "ulysses" else ()) + (groups,):
            started = time.perf_counter()
            loss_err, grad_err = _errors(*sp_step(attn, backend, dtype, device, sp_groups), ref)
            row = {"kernel": attn, "backend": backend, "dtype": str(dtype).split(".")[-1],
                   "sp": sp_groups.sp_world_size, "loss_rel_err": loss_err, "grad_rel_err": grad_err,
                   "plain_loss_rel_err": plain[0], "plain_grad_rel_err": plain[1],
                   "seconds": round(time.perf_counter() - started, 2)}  # fmt: skip
            rows.append(_judge(row, dtype))
    return rows


def skip_reason(attn: str, device: str) -> str:
    """Why a kernel's job cannot run here ("" when it can): on CPU flash-attn and flex's backward cannot run."""
    if attn == "flash_attention_2":
        if device == "cpu":
            return "flash-attn needs CUDA (its CPU stand-in is a test helper)"
        return "" if importlib.util.find_spec("flash_attn") else "flash-attn not installed"
    return "flex_attention has no CPU backward" if attn == "flex_attention" and device == "cpu" else ""


def run_job(attn: str, backend: str, nproc: int, device: str, log_dir: Path) -> list[dict[str, Any]]:
    """One job's rows (from rank 0); a failed job is one ERROR row with the end of its log."""
    from benchmarks import _harness

    name = f"{attn}-{backend}-sp{nproc}"
    kwargs = {"attn": attn, "backend": backend, "device": device, "init_backend": "gloo"}
    record = _harness.job("benchmarks.gpu_check:kernel_job", nproc, 240, log_dir, name, env=_harness.THREAD_ENV,
                          **kwargs)  # fmt: skip
    if record["status"] != "ok":
        return [{"kernel": attn, "backend": backend, "dtype": "-", "sp": nproc, "status": "ERROR",
                 "error": record["error"][-600:]}]  # fmt: skip
    return [{**row, "job_s": round(record["wall_s"], 1)} for row in record["result"]["ranks"][0]]


def matrix(device: str, log_dir: Path, expect_skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Every job at once (a thread each: the jobs are processes); skipped kernels as SKIP rows."""
    rows, runnable = [], []
    for attn, backend, nproc in JOBS:
        skip = skip_reason(attn, device)
        if skip:  # expected only where the machine cannot run it by construction, or when asked
            expected = device == "cpu" or attn in expect_skip
            rows.append({"kernel": attn, "backend": backend, "dtype": "-", "sp": nproc, "status": "SKIP",
                         "error": skip, "expected": expected})  # fmt: skip
        else:
            runnable.append((attn, backend, nproc))
    with concurrent.futures.ThreadPoolExecutor(len(runnable) or 1) as pool:
        for found in pool.map(lambda job: run_job(*job, device, log_dir), runnable):
            rows.extend(found)
    return rows


def verdict(rows: list[dict[str, Any]]) -> tuple[bool, str]:
    """Passed only if every row passed or is an expected skip; the line that says so."""
    bad = [r for r in rows if r["status"] in ("FAIL", "ERROR") or (r["status"] == "SKIP" and not r.get("expected"))]
    passed = sum(r["status"] == "PASS" for r in rows)
    skipped = sum(r["status"] == "SKIP" and bool(r.get("expected")) for r in rows)
    cells = ", ".join(" ".join(filter(None, (r["kernel"], r.get("backend"), r["dtype"], f"SP={r['sp']}", r["status"])))
                      for r in bad)  # fmt: skip
    line = f"{passed} PASS, {skipped} expected SKIP, {len(bad)} failed of {len(rows)} cells" + (
        f": {cells}" * bool(bad)
    )
    return not bad, f"gpu_check: {'PASS' if not bad else 'FAIL'}: {line}"


COLUMNS: list[_results.Column] = [
    ("kernel", lambda r: r["kernel"]), ("backend", lambda r: r.get("backend", "-")), ("dtype", lambda r: r["dtype"]),
    ("SP", lambda r: str(r["sp"])),
    ("loss rel err", lambda r: f"{r['loss_rel_err']:.1e}" if "loss_rel_err" in r else r.get("error", "")),
    ("grad rel err", lambda r: f"{r['grad_rel_err']:.1e}" if "grad_rel_err" in r else ""),
    ("plain bf16/fp32 err (loss, grad)",
     lambda r: f"{r['plain_loss_rel_err']:.1e}, {r['plain_grad_rel_err']:.1e}" if "plain_loss_rel_err" in r else ""),
    ("status", lambda r: r["status"]),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the matrix on CPU to test this script")
    parser.add_argument("--expect-skip", default="", help="comma-separated kernels whose SKIP rows are accepted")
    parser.add_argument("--from-json", type=Path, help="the verdict of a saved results file (no run)")
    parser.add_argument("--out", default=None, help="results prefix (default benchmarks/results/<date>-gpu-check)")
    args = parser.parse_args(argv)
    if args.from_json:
        ok, line = verdict(json.loads(args.from_json.read_text())["rows"])
        print(line)
        return 0 if ok else 1
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_check: no CUDA device; nothing to run (use --cpu-dry-run to exercise the script on CPU)")
        return 0
    device = "cpu" if args.cpu_dry_run else "cuda"
    prefix = Path(args.out) if args.out else RESULTS / f"{datetime.date.today()}-gpu-check"
    log_dir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    started = time.perf_counter()
    rows = matrix(device, log_dir, frozenset(filter(None, args.expect_skip.split(","))))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    meta = {"device": name, "torch": torch.__version__, "docs": DOCS, "logs": str(log_dir),
            "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    ok, line = verdict(rows)
    table = "\n".join(_results.table(COLUMNS, rows, "---"))
    md = f"# GPU check: {name}, torch {torch.__version__}, {meta['seconds']} s\n\n{table}\n\n{line}\n"
    _results.write(prefix, {"meta": meta, "rows": rows, "passed": ok}, md)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

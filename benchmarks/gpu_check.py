"""Kernel matrix on one GPU: every attention kernel through the SP path, bf16 and fp32, SP=1 and SP=2.

    python -m benchmarks.gpu_check                 # on a CUDA machine (scripts/gpu_check.sh runs it)
    python -m benchmarks.gpu_check --cpu-dry-run   # the same code on CPU (flash stand-in, flex forward only)

`matrix` runs the cells, `verdict` judges them (a SKIP is not a pass); method and tolerances: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
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


def sp_step(rank: int, world_size: int, attn: str, dtype_name: str, device: str) -> dict[str, float]:
    """One step through hf_longctx at SP=world_size; its errors against the fp32 per-document reference."""
    from hf_longctx.distributed.comm import all_reduce_sum

    if device == "cuda" and attn == "flash_attention_2" and not flash_kernel_module().startswith("flash_attn"):
        raise RuntimeError(f"flash row refused: flash_attention_2 resolves to {flash_kernel_module()}, not flash_attn")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 cells are compared at fp32 tolerances
    torch.backends.cudnn.allow_tf32 = False
    ref = plain_step("eager", torch.float32, device, per_document=True)
    sp_groups = hf_longctx.SequenceParallelGroups
    groups = sp_groups.build(world_size) if world_size > 1 else sp_groups.single()
    model = _model(attn, getattr(torch, dtype_name), device)
    with hf_longctx.enable_sequence_parallel(model, groups):
        shard = hf_longctx.shard_batch(_batch(device), groups)
        shift_labels = shard.pop("shift_labels")
        loss = hf_longctx.sequence_parallel_loss(model(**shard).logits.float(), shift_labels, groups)
        loss.backward()
    grads = {n: all_reduce_sum(g, groups.sp_group) / world_size for n, g in _grads(model).items()}
    loss_err, grad_err = _errors(loss.item(), grads, ref)
    plain = _errors(*plain_step(attn, getattr(torch, dtype_name), device, per_document=True), ref)
    return {"loss_rel_err": loss_err, "grad_rel_err": grad_err, "plain_loss_rel_err": plain[0],
            "plain_grad_rel_err": plain[1]}  # fmt: skip


def _errors(loss: float, grads: dict, ref: tuple[float, dict]) -> tuple[float, float]:
    ref_loss, ref_grads = ref
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in ref_grads.items())
    return abs(loss - ref_loss) / abs(ref_loss), worst


def kernels(device: str) -> list[tuple[str, str]]:
    """(kernel, why it is skipped here or ""): on CPU flash-attn and flex_attention's backward cannot run."""
    cpu = device == "cpu"
    flash = "flash-attn needs CUDA (its CPU stand-in is a test helper)" if cpu else ""
    no_flash = "" if cpu or importlib.util.find_spec("flash_attn") else "flash-attn not installed"
    flex = "flex_attention has no CPU backward" if cpu else ""
    return [("sdpa", ""), ("eager", ""), ("flash_attention_2", flash or no_flash), ("flex_attention", flex)]


def run_cell(attn: str, dtype: torch.dtype, sp: int, device: str, log_dir: Path) -> dict[str, Any]:
    from benchmarks import _harness

    started, dtype_name = time.perf_counter(), str(dtype).split(".")[-1]
    row: dict[str, Any] = {"kernel": attn, "dtype": dtype_name, "sp": sp}
    if sp == 1:
        row.update(sp_step(0, 1, attn, dtype_name, device))
    else:
        name = f"{attn}-{dtype_name}-sp{sp}"
        kwargs = {"attn": attn, "dtype_name": dtype_name, "device": device, "init_backend": "gloo"}
        env = _harness.THREAD_ENV  # one thread per rank: 2 ranks may share a box
        record = _harness.job("benchmarks.gpu_check:sp_step", sp, 300, log_dir, name, env=env, **kwargs)
        if record["status"] != "ok":
            raise RuntimeError(record["error"][-600:])
        row.update(record["result"]["ranks"][0])
    if dtype == torch.float32:
        ok = row["loss_rel_err"] <= 1e-4 and row["grad_rel_err"] <= 1e-3
    else:
        ok = all(row[k] <= 2 * row[f"plain_{k}"] + 1e-6 for k in ("loss_rel_err", "grad_rel_err"))
    return {**row, "seconds": round(time.perf_counter() - started, 2), "status": "PASS" if ok else "FAIL"}


def matrix(device: str, log_dir: Path, expect_skip: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """Every (kernel, dtype, SP) cell, plus the leak control; a cell that raises is recorded as ERROR."""
    ref = plain_step("eager", torch.float32, device, per_document=True)
    leak_loss, leak_grad = _errors(*plain_step("eager", torch.float32, device, per_document=False), ref)
    rows = [{"kernel": "leak control (whole row, causal only)", "dtype": "float32", "sp": 1,
             "loss_rel_err": leak_loss, "grad_rel_err": leak_grad,
             "status": "PASS" if leak_grad > 1e-2 else "FAIL"}]  # fmt: skip
    for attn, skip in kernels(device):
        for dtype in (torch.float32, torch.bfloat16):
            if attn == "flash_attention_2" and dtype == torch.float32:
                continue  # flash-attn has no fp32 kernel
            for sp in (1, 2):
                cell = {"kernel": attn, "dtype": str(dtype).split(".")[-1], "sp": sp}
                if skip:  # expected only where the machine cannot run it by construction, or when asked
                    expected = device == "cpu" or attn in expect_skip
                    rows.append({**cell, "status": "SKIP", "error": skip, "expected": expected})
                    continue
                try:
                    rows.append(run_cell(attn, dtype, sp, device, log_dir))
                except Exception as exc:  # noqa: BLE001 - one broken cell must not hide the others
                    rows.append({**cell, "status": "ERROR", "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    return rows


def verdict(rows: list[dict[str, Any]]) -> tuple[bool, str]:
    """Passed only if every row passed or is an expected skip; the line that says so."""
    bad = [r for r in rows if r["status"] in ("FAIL", "ERROR") or (r["status"] == "SKIP" and not r.get("expected"))]
    passed = sum(r["status"] == "PASS" for r in rows)
    skipped = sum(r["status"] == "SKIP" and bool(r.get("expected")) for r in rows)
    cells = ", ".join(f"{r['kernel']} {r['dtype']} SP={r['sp']} {r['status']}" for r in bad)
    line = f"{passed} PASS, {skipped} expected SKIP, {len(bad)} failed of {len(rows)} cells" + (
        f": {cells}" * bool(bad)
    )
    return not bad, f"gpu_check: {'PASS' if not bad else 'FAIL'}: {line}"


COLUMNS: list[_results.Column] = [
    ("kernel", lambda r: r["kernel"]), ("dtype", lambda r: r["dtype"]), ("SP", lambda r: str(r["sp"])),
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
    rows = matrix(device, log_dir, frozenset(filter(None, args.expect_skip.split(","))))
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    meta = {"device": name, "torch": torch.__version__, "docs": DOCS, "logs": str(log_dir)}
    ok, line = verdict(rows)
    table = "\n".join(_results.table(COLUMNS, rows, "---"))
    md = f"# GPU check: {name}, torch {torch.__version__}\n\n{table}\n\n{line}\n"
    _results.write(prefix, {"meta": meta, "rows": rows, "passed": ok}, md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

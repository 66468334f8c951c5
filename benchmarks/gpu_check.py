"""Kernel matrix on one GPU: every attention kernel through the SP path, bf16 and fp32, SP=1 and SP=2.

    python -m benchmarks.gpu_check                 # on a CUDA machine (scripts/gpu_check.sh runs it)
    python -m benchmarks.gpu_check --cpu-dry-run   # the same code on CPU (flash stand-in, flex forward only)

Each cell trains one step of a tiny random-init Llama on one packed row of three documents through
hf_longctx and compares the loss and every parameter's gradient with the fp32 reference: the plain
model run document by document (no hf_longctx), on the same device. bf16 cannot match fp32, so a bf16
cell passes when its error is within 2x (+1e-6) of the plain bf16 model's own error against that
reference, the way the kernels themselves are judged; fp32 cells must be within 1e-4 (loss) and 1e-3
(gradients). A leak control runs the plain model on the whole packed row with only a causal mask: its
error must be far larger, or the comparison could not see documents attending to each other.
SP=2 runs as two processes on the one GPU over gloo (NCCL refuses two ranks on one device); hf_longctx
moves tensors to the host for gloo collectives (`comm.group_device`). Prints a table; writes
`benchmarks/results/<date>-gpu-check.{json,md}`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = (37, 50, 41)
VOCAB = 512


def _model(attn: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from tests import _flash_standin as standin
    from tests._models import tiny_model

    flash = attn == standin.IMPLEMENTATION
    model = tiny_model("llama", num_heads=4, num_kv_heads=2, hidden=128, vocab=VOCAB, attn="eager" if flash else attn)
    if flash:
        model.config._attn_implementation = standin.IMPLEMENTATION
    return model.to(device, dtype)


def _batch(device: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (1, sum(DOCS)), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in DOCS]).unsqueeze(0)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device), "position_ids": pos.to(device)}


def _loss(logits: torch.Tensor, shift_labels: torch.Tensor, groups: Any) -> torch.Tensor:
    import hf_longctx

    return hf_longctx.sequence_parallel_loss(logits, shift_labels, groups)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}


def plain_step(attn: str, dtype: torch.dtype, device: str, per_document: bool) -> tuple[float, dict]:
    """The model without hf_longctx: each document alone (`per_document`) or the whole row, causal only."""
    import hf_longctx
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
    loss = _loss(logits.float(), shift_labels, hf_longctx.SequenceParallelGroups.single())
    loss.backward()
    return loss.item(), _grads(model)


def _install_standin(label: str) -> str:
    """The kernel name of a matrix label; a "(stand-in)" label routes flash to the CPU-API stand-in."""
    if "stand-in" in label:
        from tests import _flash_standin

        _flash_standin.install()
    return label.split(" ")[0]


def sp_step(rank: int, world_size: int, label: str, dtype_name: str, device: str) -> tuple[float, dict]:
    """One step through hf_longctx at SP=world_size (run_distributed worker, or in-process for SP=1)."""
    import hf_longctx
    from hf_longctx.distributed.comm import all_reduce_sum

    attn = _install_standin(label)
    groups = (
        hf_longctx.SequenceParallelGroups.build(world_size)
        if world_size > 1
        else hf_longctx.SequenceParallelGroups.single()
    )
    model = _model(attn, getattr(torch, dtype_name), device)
    with hf_longctx.enable_sequence_parallel(model, groups):
        shard = hf_longctx.shard_batch(_batch(device), groups)
        shift_labels = shard.pop("shift_labels")
        loss = _loss(model(**shard).logits.float(), shift_labels, groups)
        loss.backward()
    grads = {n: all_reduce_sum(g, groups.sp_group) / world_size for n, g in _grads(model).items()}
    return loss.item(), grads


def _errors(loss: float, grads: dict, ref: tuple[float, dict]) -> tuple[float, float]:
    ref_loss, ref_grads = ref
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in ref_grads.items())
    return abs(loss - ref_loss) / abs(ref_loss), worst


def kernels(device: str) -> list[tuple[str, str]]:
    """(kernel, note) pairs to run: the real flash-attn when installed, else the API stand-in."""
    flash = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "flash_attention_2 (stand-in)"
    return [("sdpa", ""), ("eager", ""), (flash, ""), ("flex_attention", "forward only" if device == "cpu" else "")]


def run_cell(attn: str, dtype: torch.dtype, sp: int, device: str, ref: tuple[float, dict]) -> dict[str, Any]:
    from tests._dist import run_distributed

    name = _install_standin(attn)
    started = time.perf_counter()
    if sp == 1:
        loss, grads = sp_step(0, 1, attn, str(dtype).split(".")[-1], device)
    else:
        loss, grads = run_distributed(sp_step, sp, attn, str(dtype).split(".")[-1], device, timeout=300)[0]
    loss_err, grad_err = _errors(loss, grads, ref)
    plain_loss_err, plain_grad_err = _errors(*plain_step(name, dtype, device, per_document=True), ref)
    if dtype == torch.float32:
        ok = loss_err <= 1e-4 and grad_err <= 1e-3
    else:
        ok = loss_err <= 2 * plain_loss_err + 1e-6 and grad_err <= 2 * plain_grad_err + 1e-6
    return {
        "kernel": attn,
        "dtype": str(dtype).split(".")[-1],
        "sp": sp,
        "loss_rel_err": loss_err,
        "grad_rel_err": grad_err,
        "plain_loss_rel_err": plain_loss_err,
        "plain_grad_rel_err": plain_grad_err,
        "seconds": round(time.perf_counter() - started, 2),
        "status": "PASS" if ok else "FAIL",
    }


def matrix(device: str) -> list[dict[str, Any]]:
    """Every (kernel, dtype, SP) cell, plus the leak control; a cell that raises is recorded as ERROR."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 cells are compared at fp32 tolerances
    torch.backends.cudnn.allow_tf32 = False
    ref = plain_step("eager", torch.float32, device, per_document=True)
    leak_loss, leak_grad = _errors(*plain_step("eager", torch.float32, device, per_document=False), ref)
    rows = [{"kernel": "leak control (whole row, causal only)", "dtype": "float32", "sp": 1,
             "loss_rel_err": leak_loss, "grad_rel_err": leak_grad,
             "status": "PASS" if leak_grad > 1e-2 else "FAIL"}]  # fmt: skip
    for attn, note in kernels(device):
        for dtype in (torch.float32, torch.bfloat16):
            if attn.startswith("flash_attention_2") and "stand-in" not in attn and dtype == torch.float32:
                continue  # flash-attn has no fp32 kernel
            for sp in (1, 2):
                try:
                    if note == "forward only":
                        raise NotImplementedError("flex_attention has no CPU backward")
                    rows.append(run_cell(attn, dtype, sp, device, ref))
                except Exception as exc:  # noqa: BLE001 - one broken cell must not hide the others
                    status = "SKIP" if isinstance(exc, NotImplementedError) else "ERROR"
                    rows.append({"kernel": attn, "dtype": str(dtype).split(".")[-1], "sp": sp, "status": status,
                                 "error": f"{type(exc).__name__}: {str(exc)[:300]}"})  # fmt: skip
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| kernel | dtype | SP | loss rel err | grad rel err | plain bf16/fp32 err (loss, grad) | status |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        plain = f"{r['plain_loss_rel_err']:.1e}, {r['plain_grad_rel_err']:.1e}" if "plain_loss_rel_err" in r else ""
        errs = (
            f"{r['loss_rel_err']:.1e} | {r['grad_rel_err']:.1e}" if "loss_rel_err" in r else f"{r.get('error', '')} |"
        )
        lines.append(f"| {r['kernel']} | {r['dtype']} | {r['sp']} | {errs} | {plain} | {r['status']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the matrix on CPU to test this script")
    parser.add_argument("--out", default=None, help="results prefix (default benchmarks/results/<date>-gpu-check)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("gpu_check: no CUDA device; nothing to run (use --cpu-dry-run to exercise the script on CPU)")
        return 0
    device = "cpu" if args.cpu_dry_run else "cuda"
    sys.path.insert(0, str(ROOT))
    rows = matrix(device)
    text = table(rows)
    print(text)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    prefix = Path(args.out) if args.out else RESULTS / f"{datetime.date.today()}-gpu-check"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "torch": torch.__version__, "docs": DOCS}
    prefix.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    prefix.with_suffix(".md").write_text(f"# GPU check: {name}, torch {torch.__version__}\n\n{text}\n")
    failed = [r for r in rows if r["status"] in ("FAIL", "ERROR")]
    print(f"gpu_check: {len(rows) - len(failed)} of {len(rows)} cells PASS/SKIP; results in {prefix}.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Which block kernel runs each mask on one GPU, and how far ring and tile results are from float64.

    python -m benchmarks.gpu_kernels                  # one GPU: a process per dtype (a CUDA fault stays in it)
    python -m benchmarks.gpu_kernels --cpu-dry-run    # the same flow on CPU (cpu_flash everywhere)

For every dtype (bf16, fp16, fp32), mask (causal, packed documents, packed + sliding window, sliding window) and
ring size (1: the whole row in one block; 2, 4, 8: zigzag), a virtual ring (`attention/ring/virtual.py`) runs the
kernels `select_kernel` picks; tile attention runs 511 tokens in tiles of 101 and 8,195 in tiles of 4,096. Each
block call is also repeated by the math kernel in float64 on the same inputs (the backward with the same merged
out and LSE): the worst relative error of any single call pins a wrong result to its kernel. A row PASSes with the
bound of tests/gpu: error <= 2 x the whole-row run's + world x eps(dtype) x max |reference|.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import _results

EPS = {"bf16": 2**-8, "fp16": 2**-11, "fp32": 2**-10}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KINDS = ("causal", "packed", "packed_window", "window")
DOCS = [(101, 1, 211, 199), (51, 299, 162)]  # odd lengths; rows of blocks that see no key of the block


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if bool(torch.isnan(a).any()):
        return math.inf
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


class Audited:
    """A block kernel whose every call is repeated by the float64 math kernel on the same inputs."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.name, self.worst = kernel, kernel.name, 0.0

    def forward(self, q, k, v, *, causal, allowed, scale, segments=None):
        from hf_longctx.attention.lse.contract import dense_mask
        from hf_longctx.attention.lse.cpu import MathKernel

        out, lse = self.kernel.forward(q, k, v, causal=causal, allowed=allowed, scale=scale, segments=segments)
        mask = dense_mask(q, k, allowed, segments)
        ref, _ = MathKernel().forward(q.double(), k.double(), v.double(), causal=causal, allowed=mask, scale=scale)
        self.worst = max(self.worst, _rel(out, ref))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, causal, allowed, scale, segments=None):
        from hf_longctx.attention.lse.contract import dense_mask
        from hf_longctx.attention.lse.cpu import MathKernel

        grads = self.kernel.backward(dout, q, k, v, out, lse, causal=causal, allowed=allowed, scale=scale,
                                     segments=segments)  # fmt: skip
        mask = dense_mask(q, k, allowed, segments)
        doubles = (t.double() for t in (dout, q, k, v, out, lse))
        ref = MathKernel().backward(*doubles, causal=causal, allowed=mask, scale=scale)
        self.worst = max(self.worst, *(_rel(g, r) for g, r in zip(grads, ref, strict=True)))
        return grads


def _chooser(kernels: dict[str, Audited], used: dict[str, str]):
    from hf_longctx.attention.lse.choose import select_kernel

    def kernel_for(q, plan):
        kernel = select_kernel(q, plan)
        kind = "packed" if plan.segments is not None else "masked" if plan.masked else "dense"
        used[kind] = kernel.name
        return kernels.setdefault(kernel.name, Audited(kernel))

    return kernel_for


def _verdict(got, single, ref, world: int, eps: float) -> dict[str, Any]:
    errors, ok = {}, True
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, single, ref, strict=True):
        scale = c.abs().max().item()
        err, base = _rel(a, c) * scale, _rel(b, c) * scale
        errors[name] = round(err / scale, 6)
        ok = ok and err <= 2 * base + world * eps * scale
    return {"errors": errors, "status": "PASS" if ok else "FAIL"}


def ring_row(dtype: str, kind: str, world: int, device: str) -> dict[str, Any]:
    from hf_longctx.attention.ring.plan import VisibilityRule
    from hf_longctx.attention.ring.virtual import reference, virtual_ring

    g = torch.Generator(device=device).manual_seed(world)
    q = torch.randn(2, 8, 512, 64, device=device, generator=g).to(DTYPES[dtype])
    k, v = (torch.randn(2, 2, 512, 64, device=device, generator=g).to(DTYPES[dtype]) for _ in range(2))
    dout = torch.randn(2, 8, 512, 64, device=device, generator=g).to(DTYPES[dtype])
    doc = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in DOCS]).to(device)
    rule = VisibilityRule(doc if kind.startswith("packed") else None, window=37 if kind.endswith("window") else None)
    pos = torch.arange(512, device=device)
    ref = reference(q, k, v, dout, rule.allowed(pos, pos)[:, None], 0.125)
    kernels, used = {}, {}
    got = virtual_ring(q, k, v, dout, world, "zigzag" if world > 1 else "contiguous", rule, 0.125,
                       _chooser(kernels, used))  # fmt: skip
    single = virtual_ring(q, k, v, dout, 1, "contiguous", rule, 0.125, _chooser({}, {}))
    worst = max((a.worst for a in kernels.values()), default=0.0)
    return {"what": f"ring {kind}", "dtype": dtype, "world": world, "kernels": used, "worst_call": worst,
            **_verdict(got, single, ref, world, EPS[dtype])}  # fmt: skip


def tile_row(dtype: str, seq: int, lengths: tuple[int, ...], tile: int, device: str) -> dict[str, Any]:
    from hf_longctx.attention.lse.choose import choose_kernel
    from hf_longctx.attention.ring.virtual import reference
    from hf_longctx.memory import tile_attention as T

    d, heads = (128, (4, 1)) if seq > 4096 else (64, (8, 2))
    g = torch.Generator(device=device).manual_seed(seq)
    q = torch.randn(1, heads[0], seq, d, device=device, generator=g).to(DTYPES[dtype])
    k, v = (torch.randn(1, heads[1], seq, d, device=device, generator=g).to(DTYPES[dtype]) for _ in range(2))
    dout = torch.randn(1, heads[0], seq, d, device=device, generator=g).to(DTYPES[dtype])
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    segments = [list(zip(bounds[:-1], bounds[1:], strict=True))]
    doc = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    kernel = Audited(choose_kernel(q.device.type, q.dtype, masked=False, head_dims=(d, d)))
    T._kernel = lambda q_, v_: kernel

    def tiled(size: int):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        grads = T.KVGradients()
        kt, vt = T.release_kv(kk, vv, grads)
        edges = [*range(0, seq, size), seq]
        outs = []
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            pieces = T.plan_pieces(segments, [(0, a, b - a)])
            outs.append(T.tile_attention(qq[:, :, a:b], kt, vt, pieces, d**-0.5, grads))
        out = torch.cat(outs, 2)
        return out.detach(), *torch.autograd.grad(out, (qq, kk, vv), dout)

    got, single = tiled(tile), tiled(seq)
    ref = reference(q, k, v, dout, allowed, d**-0.5)
    return {"what": f"tiles of {tile} over {seq}", "dtype": dtype, "world": -(-seq // tile),
            "kernels": {"dense": kernel.name}, "worst_call": kernel.worst,
            **_verdict(got, single, ref, min(-(-seq // tile), 8), EPS[dtype])}  # fmt: skip


def rows_for(dtype: str, device: str) -> list[dict[str, Any]]:
    """Every row of one dtype; an exception is one ERROR row (the rest go on)."""
    cases = [(ring_row, (dtype, kind, world, device)) for kind in KINDS for world in (1, 2, 4, 8)]
    cases += [(tile_row, (dtype, 511, (300, 17, 194), 101, device))]
    if dtype == "bf16" and device == "cuda":
        cases += [(tile_row, (dtype, 8195, (5003, 3192), 4096, device))]
    rows = []
    for fn, args in cases:
        try:
            rows.append(fn(*args))
        except Exception:  # noqa: BLE001 - one broken case must not hide the others
            rows.append({"what": fn.__name__, "dtype": dtype, "world": args[2], "status": "ERROR",
                         "error": traceback.format_exc()[-800:]})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


COLUMNS: list[_results.Column] = [
    ("what", lambda r: r["what"]), ("dtype", lambda r: r["dtype"]), ("world", lambda r: str(r["world"])),
    ("kernels (block kind: kernel)", lambda r: ", ".join(f"{k}: {v}" for k, v in r.get("kernels", {}).items())),
    ("rel err out / dq / dk / dv", lambda r: " / ".join(f"{e:.1e}" for e in r["errors"].values()) if "errors" in r
     else r.get("error", "")[-200:].replace("\n", " ")),
    ("worst single call", lambda r: f"{r['worst_call']:.1e}" if "worst_call" in r else ""),
    ("status", lambda r: r["status"]),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="the flow on CPU (cpu_flash everywhere)")
    parser.add_argument("--dtype", help="run one dtype in this process (the parent runs one process per dtype)")
    parser.add_argument("--out", help="results prefix (default benchmarks/results/<date>-gpu-kernels)")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device; nothing to run (use --cpu-dry-run)")
        return 0
    if args.dtype:
        rows_for(args.dtype, device)
        return 0
    flags = ["--cpu-dry-run"] if args.cpu_dry_run else []

    def run(dtype: str) -> list[dict[str, Any]]:
        cmd = [sys.executable, "-m", "benchmarks.gpu_kernels", "--dtype", dtype, *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode:
            rows.append({"what": "process", "dtype": dtype, "world": "-", "status": "ERROR",
                         "error": proc.stderr[-800:]})  # fmt: skip
        return rows

    with concurrent.futures.ThreadPoolExecutor(len(DTYPES)) as pool:
        rows = [row for found in pool.map(run, DTYPES) for row in found]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    bad = [r for r in rows if r["status"] != "PASS"]
    line = f"gpu_kernels: {'PASS' if not bad else 'FAIL'}: {len(rows) - len(bad)} of {len(rows)} rows pass"
    table = "\n".join(_results.table(COLUMNS, rows, "---"))
    md = f"# Block kernels on {name}, torch {torch.__version__}\n\n{table}\n\n{line}\n"
    prefix = args.out or str(_results.RESULTS / f"{datetime.date.today()}-gpu-kernels")
    _results.write(Path(prefix), {"device": name, "torch": torch.__version__, "rows": rows, "passed": not bad}, md)
    print(line)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

"""GPU-only kernel paths through hf_longctx at SP=1 and 2: the kernel matrix of `benchmarks/gpu_check.py`.

NCCL refuses two ranks on one device, so SP=2 runs as two processes on the one GPU over gloo: hf_longctx
moves each collective's tensors to the host for gloo (`comm.group_device`), the kernels run on CUDA. Each
cell is one training step on a packed row of three documents, compared with the fp32 plain model run
document by document; a leak control shows the comparison sees documents that attend to each other. The
benchmark runs as a command (tests do not import benchmarks); every cell must PASS: a skipped flash or
flex row is a failure here, and so is a flash row that resolved to anything but the flash_attn package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_kernel_matrix_passes_every_cell_on_cuda(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "check")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    kernels = {r["kernel"] for r in rows if r["status"] == "PASS"}
    assert {"sdpa", "eager", "flash_attention_2", "flex_attention"} <= kernels, proc.stdout[-3000:]
    assert [r for r in rows if r["status"] != "PASS"] == [], proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

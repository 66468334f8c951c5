"""`scripts/gpu_check.sh` without a GPU: exits 0 with one clear line (CUDA hidden, so this holds anywhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_without_cuda_says_so_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "gpu_check: no CUDA device; nothing to run"


def test_ladder_mode_without_cuda_exits_0_and_an_unknown_mode_exits_2():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    script = str(ROOT / "scripts" / "gpu_check.sh")
    ladder = subprocess.run(["bash", script, "ladder"], capture_output=True, text=True, env=env, timeout=120)
    assert ladder.returncode == 0 and ladder.stdout.strip() == "gpu_check: no CUDA device; nothing to run"
    bad = subprocess.run(["bash", script, "nope"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "unknown mode 'nope'" in bad.stderr

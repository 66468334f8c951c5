"""A GPU recipe started where no CUDA device is visible stops with one line naming why and what to do, not with
transformers' bf16 traceback (printed by every process of a launch, its hint `use_cpu` wrong on a GPU node)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# Every recipe script parses through `recipes/_parse.py`; SFT and GRPO call it each way (a parser built inline, and
# one kept for later use).
CASES = [("sft.py", "llama31_8b_512k_sp8.yaml"), ("grpo.py", "qwen3_4b_grpo_sp4.yaml")]


@pytest.mark.parametrize(("script", "recipe"), CASES)
def test_a_gpu_recipe_without_a_gpu_says_so_in_one_line(script, recipe):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # also on a GPU machine: no device visible
    done = subprocess.run(
        [sys.executable, f"recipes/{script}", "--config", f"recipes/{recipe}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "sees no CUDA device" in done.stderr and "install.sh" in done.stderr, done.stderr[-2000:]
    assert torch.__version__ in done.stderr

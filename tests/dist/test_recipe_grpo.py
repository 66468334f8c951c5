"""recipes/grpo.py with its CPU YAML trains under torchrun at SP=2 (ranks of one SP group generate the same
completions, the log-prob forward and loss run sharded), the way a user launches it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"grpo recipe: (\d+) steps, sp=(\d+), attention=(\S+)")


@pytest.mark.slow
def test_grpo_recipe_trains_at_sp2(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "recipes/grpo.py",
           "--config", "recipes/tiny_grpo_cpu.yaml", "--output_dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    found = LINE.findall(done.stdout)
    assert len(found) == 2, done.stdout[-2000:]
    for steps, sp, attention in found:
        assert (int(steps), int(sp)) == (2, 2) and attention.startswith("hf_longctx_ulysses"), (steps, sp, attention)

"""recipes/sft.py with `sp_backend: auto` on the 9-query / 3-kv-head tiny Llama: SP=2 (auto picks the ring)
through accelerate launch reproduces the loss curve of the same recipe without SP."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.dist.test_recipe import ROOT, SMALL


@pytest.mark.slow
def test_nine_head_recipe_with_auto_matches_no_sp(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    recipe = ["recipes/sft.py", "--config", "recipes/tiny_smollm2_heads_2k_auto_sp2.yaml", *SMALL]
    ref, sp = str(tmp_path / "sp1"), str(tmp_path / "sp2")
    run = {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "timeout": 400}
    done = subprocess.run([sys.executable, *recipe, "--sp_size", "1", "--output_dir", ref], **run)
    assert done.returncode == 0, done.stderr[-4000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu_sp2.yaml"]
    done = subprocess.run([*launch, *recipe, "--output_dir", sp, "--compare_to", ref], **run)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "sequence parallelism: SPBackend(name='ring', sp_size=2, ulysses_degree=1" in done.stdout, done.stdout[
        -2000:
    ]
    match = re.search(r"max relative difference ([0-9.e+-]+) over 3 steps", done.stdout)
    assert match, done.stdout[-2000:]
    assert float(match.group(1)) <= 1e-5

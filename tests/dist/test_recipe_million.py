"""The million-token SFT recipe (recipes/llama31_8b_1m_sp8.yaml) shrunk to a CPU: the same YAML and script, the tiny
offline Llama, rows of 8K tokens of whole vendored texts packed by TRL; SP=2 through accelerate launch trains like
the same recipe at sp_size 1 (where hf_longctx still serves attention and the memory flags)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHRINK = ["--model_name_or_path", "tiny", "--max_length", "8192", "--document_repeats", "1", "--max_steps", "2",
          "--tiny_layers", "1", "--bf16", "false", "--use_cpu", "true"]  # fmt: skip


@pytest.mark.slow
def test_million_token_recipe_shrunk_sp2_matches_sp1(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    recipe = ["recipes/sft.py", "--config", "recipes/llama31_8b_1m_sp8.yaml", *SHRINK]
    ref, sp = str(tmp_path / "sp1"), str(tmp_path / "sp2")
    done = subprocess.run([sys.executable, *recipe, "--sp_size", "1", "--output_dir", ref], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu_sp2.yaml"]
    done = subprocess.run([*launch, *recipe, "--sp_size", "2", "--output_dir", sp, "--compare_to", ref], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    match = re.search(r"max relative difference ([0-9.e+-]+) over 2 steps", done.stdout)
    assert match, done.stdout[-2000:]
    assert float(match.group(1)) <= 1e-5

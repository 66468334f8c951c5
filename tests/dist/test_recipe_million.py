"""The million-token SFT recipe (recipes/llama31_8b_1m_sp8.yaml) shrunk to a CPU: the same YAML and script, the tiny
offline Llama with 2,048 native positions, documents of 8K tokens cut from the shipped texts concatenated, one per
row, and the recipe's YaRN scaled down with it (factor 4 over the 2,048, which the recipe checks against the model):
SP=2 through accelerate launch trains like the same recipe at sp_size 1 at positions past the native limit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = "recipes/llama31_8b_1m_sp8.yaml"
LENGTH, NATIVE = 8192, 2048
SHRINK = ["--model_name_or_path", "tiny", "--tiny_positions", str(NATIVE), "--max_length", str(LENGTH),
          "--document_repeats", "1", "--max_windows", "2", "--max_steps", "2", "--tiny_layers", "1", "--bf16", "false",
          "--use_cpu", "true"]  # fmt: skip


def _shrunk_rope() -> dict:
    """The recipe's RoPE with its native positions and factor scaled to this test's rows."""
    with open(os.path.join(ROOT, RECIPE)) as f:
        rope = dict(yaml.safe_load(f)["rope_parameters"])
    assert rope["rope_type"] == "yarn" and rope["factor"] * rope["original_max_position_embeddings"] == 1 << 20
    return {**rope, "original_max_position_embeddings": NATIVE, "factor": LENGTH / NATIVE}


@pytest.mark.slow
def test_million_token_recipe_shrunk_sp2_matches_sp1_past_the_native_positions(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HOME": str(tmp_path / "hf")}
    recipe = ["recipes/sft.py", "--config", RECIPE, *SHRINK, "--rope_parameters", json.dumps(_shrunk_rope())]
    ref, sp = str(tmp_path / "sp1"), str(tmp_path / "sp2")
    done = subprocess.run([sys.executable, *recipe, "--sp_size", "1", "--output_dir", ref], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"training rows: 2 documents of {LENGTH:,} tokens" in done.stdout, done.stdout[-2000:]
    assert f'"rope_type": "yarn"}}, {LENGTH:,} positions' in done.stdout, done.stdout[-2000:]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu_sp2.yaml"]
    done = subprocess.run([*launch, *recipe, "--sp_size", "2", "--output_dir", sp, "--compare_to", ref], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    match = re.search(r"max relative difference ([0-9.e+-]+) over 2 steps", done.stdout)
    assert match, done.stdout[-2000:]
    assert float(match.group(1)) <= 1e-5
    with open(os.path.join(sp, "config.json")) as f:
        config = json.load(f)  # the trained model carries the recipe's RoPE
    assert config["max_position_embeddings"] == LENGTH
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == LENGTH / NATIVE
    # The rows run past the native positions (without the scaling they are refused at the first step:
    # tests/dist/test_bad_inputs.py "too_long").
    assert config["rope_parameters"]["original_max_position_embeddings"] == NATIVE < LENGTH

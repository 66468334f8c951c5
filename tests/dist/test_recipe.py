"""The main job's pieces at a small size: recipes/sft.py without SP, then with SP=2 through accelerate launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--max_length", "512", "--max_steps", "3", "--max_windows", "6", "--tiny_layers", "1", "--save_strategy", "no"]


@pytest.mark.slow
def test_recipe_sp2_loss_curve_matches_no_sp(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    recipe = ["recipes/sft.py", "--config", "recipes/tiny_llama_4k_sp2.yaml", *SMALL]
    ref, sp = str(tmp_path / "sp1"), str(tmp_path / "sp2")
    done = subprocess.run(
        [sys.executable, *recipe, "--sp_size", "1", "--output_dir", ref],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    reference_log = done.stdout + done.stderr
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu_sp2.yaml"]
    done = subprocess.run(
        [*launch, *recipe, "--output_dir", sp, "--compare_to", ref],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    match = re.search(r"max relative difference ([0-9.e+-]+) over 3 steps", done.stdout)
    assert match, done.stdout[-2000:]
    assert float(match.group(1)) <= 1e-5
    assert os.path.getsize(os.path.join(sp, "loss_curves.png")) > 0
    assert "tokens_per_second" in done.stdout + done.stderr  # one per log line, printed by the progress bar
    # A newcomer's first run: no deprecation warning the project could avoid, and a model card that is true.
    for log in (reference_log, done.stdout + done.stderr):
        assert "FutureWarning" not in log, log[-3000:]
        assert "\x1b[" not in log, "a terminal escape in the job's output"
    with open(os.path.join(sp, "README.md")) as card:
        assert card.read().startswith("# Tiny random-init Llama trained by hf_longctx")

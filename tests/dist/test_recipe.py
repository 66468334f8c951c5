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


def test_an_explicit_dataset_name_is_what_trains(tmp_path):
    """`--dataset_name` (a local folder) over a recipe's `long_documents: true`: its rows, one optimizer step each
    for one epoch, are what trains (the shipped texts would give other rows and other steps)."""
    import json

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"text": f"row {i}: " + "all the world's a stage " * (5 + i)} for i in range(5)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    args = ["--sp_size", "1", "--dataset_name", str(data), "--long_documents", "true", "--max_steps", "-1"]
    args += ["--num_train_epochs", "1", "--max_length", "64", "--tiny_layers", "1", "--save_strategy", "no"]
    args += ["--output_dir", str(out)]
    done = subprocess.run(
        [sys.executable, "recipes/sft.py", "--config", "recipes/tiny_llama_4k_sp2.yaml", *args],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"the train split of dataset_name {data} (long_documents: true of the recipe unused)" in done.stdout
    with open(out / "trainer_state.json") as state:
        assert json.load(state)["global_step"] == len(rows)

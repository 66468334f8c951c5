"""`hf-longctx plan --gpu cpu` against peak memory measured by `benchmarks/plan_validate.py`, run as a command.

Each point is real training in fresh gloo processes (tiny Llama, float32, stock `Trainer`, AdamW, three
optimizer steps; SP=2 through `hf_longctx.ParallelismConfig`, without and with the memory flags): each
rank's peak resident memory growth from just before the model is built. The planner's CPU runtime term is
calibrated once, on the first point; the others are predictions that must land within 10% of the measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.10
FLAGS = {"tiled_loss": True, "tiled_mlp": 2, "offload_activations": True}
POINTS = [
    {"name": "sp1-s2048", "seq_len": 2048, "sp": 1},  # the calibration point
    {"name": "sp2-s4096", "seq_len": 4096, "sp": 2},
    {"name": "sp2-s4096-gc", "seq_len": 4096, "sp": 2, "gradient_checkpointing": True},
    # The three memory flags (2 MLP tiles: 2,048 tokens per rank would otherwise run the MLP whole).
    {"name": "sp2-s4096-all-flags", "seq_len": 4096, "sp": 2, "flags": FLAGS},
]


@pytest.mark.slow  # four fresh spawns and twelve optimizer steps: ~60 s on an idle 2-core machine
def test_cpu_predictions_within_tolerance_of_measured_peaks(tmp_path):
    report_path = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "benchmarks.plan_validate", "--points", json.dumps(POINTS),
           "--json", str(report_path), "--no-write"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    report = json.loads(report_path.read_text())
    rows = {row["name"]: row for row in report["rows"]}
    assert set(rows) == {p["name"] for p in POINTS} and all("measured_gib" in r for r in rows.values()), rows
    runtime = report["runtime_gib"]
    assert 0 <= runtime < 0.25, f"runtime term {runtime:.3f} GiB: the calibration point is not tensor-dominated"
    errors = {name: row["rel_error"] for name, row in rows.items() if row["status"] == "predicted"}
    assert len(errors) == len(POINTS) - 1 and all(abs(e) <= TOLERANCE for e in errors.values()), (runtime, rows)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The measurement must resolve the terms: checkpointing lowers the measured peak by a visible margin.
    measured = {name: row["measured_gib"] for name, row in rows.items()}
    assert measured["sp2-s4096-gc"] < 0.9 * measured["sp2-s4096"], measured
    assert measured["sp2-s4096-all-flags"] < 0.9 * measured["sp2-s4096-gc"], measured

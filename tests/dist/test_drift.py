"""A short run of `benchmarks/drift.py`, as a command (300 steps and results in benchmarks/results/*-drift.md).

60 optimizer steps of the default tiny Llama at SP=2 through the stock Trainer on 12 windows of 32 tokens
(five epochs: every epoch starts a fresh sampler pass and loader iterator): after a 20-step warm-up resident
memory grows by at most 1%, the number of threads does not change and the number of process groups never
does. The benchmark's exit status carries its verdicts; the test reads its JSON for the numbers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

STEPS, WARMUP = 60, 20
ROOT = Path(__file__).resolve().parents[2]


def test_short_run_does_not_drift(tmp_path, record_property):
    cmd = [sys.executable, "-m", "benchmarks.drift", "--steps", str(STEPS), "--warmup", str(WARMUP),
           "--seq-len", "32", "--windows", "12", "--sp", "2", "--out", str(tmp_path / "run-drift")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("*-drift.json")
    saved = json.loads(result.read_text())
    per_rank, summary = saved["samples"], saved["summary"]
    assert [len(samples) for samples in per_rank] == [STEPS, STEPS]
    assert all(summary["ok"].values()), summary["ok"]
    for rank in summary["ranks"]:
        assert rank["rss_floor_growth"] <= 0.01, rank  # what a leak raises (the median swings with glibc)
        assert len(rank["threads"]) == 1, rank
        # The default group plus this rank's SP and DP groups, from the first step to the last.
        assert rank["groups"] == [3], rank
        # Noise on a shared machine, but not a trend: the second half is not much slower than the first.
        assert rank["step_time_ratio"] < 1.5, rank
    record_property("summary", summary["ranks"])
    record_property("median_step_s", statistics.median(s["step_s"] for s in per_rank[0]))

"""A short run of `benchmarks/drift.py`, as a command (300 steps and results in benchmarks/results/*-drift.md).

40 optimizer steps of the default tiny Llama at SP=2 through the stock Trainer on 8 windows of 32 tokens
(five epochs: every epoch starts a fresh sampler pass and loader iterator). Judged by counts noise cannot move:
after an 8-step warm-up the highest number of live tensors, their storage bytes and live Python objects created
since the first step (after a collection) in the last 16 steps is no higher than in the first 16 (each window
spans two epochs), the number of threads does not change and the number of process groups
never does. Resident memory and step time over a short run on a shared machine are noise (a floor once rose 3.6%
while the RSS slope was -16 MiB per 100 steps): the benchmark's long run judges RSS, and this run only reports it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

STEPS, WARMUP, WINDOWS = 40, 8, 8
ROOT = Path(__file__).resolve().parents[2]


def test_short_run_does_not_drift(tmp_path, record_property):
    cmd = [sys.executable, "-m", "benchmarks.drift", "--steps", str(STEPS), "--warmup", str(WARMUP),
           "--seq-len", "32", "--windows", str(WINDOWS), "--sp", "2", "--judge", "counts",
           "--out", str(tmp_path / "run-drift")]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = tmp_path.glob("*-drift.json")
    saved = json.loads(result.read_text())
    per_rank, summary = saved["samples"], saved["summary"]
    assert [len(samples) for samples in per_rank] == [STEPS, STEPS]
    assert all(summary["ok"][k] for k in ("census", "threads", "groups")), summary["ok"]
    for rank in summary["ranks"]:
        # What a leak raises, counted: the last window's highest counts against the first window's.
        for name, (first, last) in rank["census"].items():
            assert last <= first, (name, rank)
        assert rank["census"]["tensors"][0] > 0, rank  # the census sees each step's tensors (batch, loss)
        assert len(rank["threads"]) == 1, rank
        # The default group plus this rank's SP and DP groups, from the first step to the last.
        assert rank["groups"] == [3], rank
    record_property("summary", summary["ranks"])
    record_property("median_step_s", statistics.median(s["step_s"] for s in per_rank[0]))

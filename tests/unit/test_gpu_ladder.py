"""`benchmarks.gpu_ladder`: the depth it picks for 128 GiB of host RAM, FAIL (never SKIP) for rungs it cannot run,
and the whole flow as a CPU dry run (tiny model, two real Trainer jobs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import _harness, gpu_ladder
from hf_longctx.planner import DEVICES

H200 = DEVICES["h200"]
ROOT = Path(__file__).resolve().parents[2]


def test_depth_fits_128_gib_of_host_ram_and_grows_with_it():
    layers = gpu_ladder.choose_layers(False, 2_000_000, 128.0, gpu_ladder.FLAGS, H200)
    assert layers == 4  # 16 GiB of pinned input per layer at 2M, next to ~19 GiB of offloaded states
    spec = gpu_ladder.model_spec(False, layers)
    assert gpu_ladder.host_gib(spec, 2_000_000, gpu_ladder.FLAGS, H200) <= 128 - gpu_ladder.HOST_RESERVE_GIB
    assert gpu_ladder.choose_layers(False, 2_000_000, 512.0, gpu_ladder.FLAGS, H200) > layers
    # The scaling to 32 layers: with activations offloaded the depth-dependent GPU terms are 0 from 2 layers on.
    full, run = gpu_ladder.model_spec(False, 32), spec
    assert gpu_ladder.plan(full, 2_000_000, gpu_ladder.FLAGS, H200).peak_gib == pytest.approx(
        gpu_ladder.plan(run, 2_000_000, gpu_ladder.FLAGS, H200).peak_gib, abs=0.01
    )


def test_without_cuda_it_fails(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_ladder.main([]) == 1
    assert "FAIL: no CUDA device" in capsys.readouterr().out


def test_flags_the_config_refuses_fail_every_rung_unrun(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_ladder, "config_refusal", lambda flags: "ParallelismConfig refuses them: no pair")
    monkeypatch.setattr(_harness, "job", lambda *a, **k: pytest.fail("a rung ran with refused flags"))
    argv = ["--cpu-dry-run", "--rungs", "2048", "--throughput-lengths", "1024", "--out-prefix", str(tmp_path / "x")]
    assert gpu_ladder.main(argv) == 1
    records = json.loads((tmp_path / "x.json").read_text())["records"]
    assert [r["verdict"] for r in records] == ["FAIL", "FAIL"] and all("no pair" in r["why"] for r in records)


def test_cpu_dry_run_runs_the_whole_flow(tmp_path):
    """As a command (a whole benchmark: two real Trainer jobs of the tiny model under ZeRO-3 offload on CPU)."""
    argv = ["--cpu-dry-run", "--rungs", "2048", "--throughput-lengths", "1024", "--out-prefix", str(tmp_path / "dry")]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_ladder", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "dry.json").read_text())
    assert report["passed"] and [r["kind"] for r in report["records"]] == ["ladder", "throughput"]
    ladder, throughput = report["records"]
    assert ladder["verdict"] == "PASS" and ladder["layers"] == 2 and ladder["measured_gib"] > 0
    assert ladder["scaled_gib"] == pytest.approx(ladder["measured_gib"] + ladder["depth_terms_gib"], abs=2e-3)
    assert throughput["tokens_per_s"] > 0 and len(throughput["step_s"]) == 2
    assert "tiled_layer" in report["flags"]
    assert ladder["flags_active"] == {flag: True for flag in report["flags"]}  # every flag checked, and applied
    assert "PASS ladder S=2,048" in proc.stdout and (tmp_path / "dry.md").exists()

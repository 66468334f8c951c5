"""The benchmark's pure functions: theory bytes, per-run and per-cell medians, ratios, markdown, plan order."""

from __future__ import annotations

import pytest

from benchmarks import _measure, report
from benchmarks.run import PROFILES, make_spec, plan

MODEL = {"name": "m", "arch": "llama", "heads": 8, "kv_heads": 8, "head_dim": 32, "layers": 2, "vocab": 64}


def test_theory_bytes_per_step_formula():
    # (2*H*d + 2*H_kv*d) * (S/P) * (P-1)/P * bytes per layer forward, x2 for backward, x layers
    per_layer_fwd = (2 * 8 * 32 + 2 * 8 * 32) * (4096 / 4) * (3 / 4) * 4
    assert report.theory_bytes_per_step(8, 8, 32, 2, 4096, 4, 4) == pytest.approx(2 * 2 * per_layer_fwd)
    # GQA: fewer kv heads send less; SP=1 sends nothing
    assert report.theory_bytes_per_step(32, 8, 128, 1, 1024, 2, 2) == pytest.approx(
        2 * (2 * 32 * 128 + 2 * 8 * 128) * 512 * 0.5 * 2
    )
    assert report.theory_bytes_per_step(8, 8, 32, 2, 4096, 1, 4) == 0
    # activation checkpointing replays the forward exchange in the backward: 3 passes instead of 2
    assert report.theory_bytes_per_step(8, 8, 32, 2, 4096, 4, 4, recompute=True) == pytest.approx(3 * 2 * per_layer_fwd)


def _step(step_s, act, a2a_bytes, a2a_s=0.1, before=100, other=None):
    return {
        "step_s": step_s,
        "iter_s": step_s + 0.01,
        "mem_before": before,
        "mem_peak": before + act,
        "act_bytes": act,
        "a2a_calls": 8,
        "a2a_bytes": a2a_bytes,
        "a2a_s": a2a_s,
        "hf_a2a_calls": 8,
        "hf_a2a_bytes": a2a_bytes,
        "hf_a2a_s": a2a_s,
        "other_comm": other or {"all_reduce": [3, 1000.0, 0.01]},
    }


def _result(rank_steps, peak=500):
    return {"ranks": [{"steps": steps, "process_peak_bytes": peak + i} for i, steps in enumerate(rank_steps)]}


def test_run_summary_skips_warmup_and_combines_ranks():
    rank0 = [_step(99.0, 10**9, 7), _step(1.0, 10, 64), _step(3.0, 30, 64), _step(2.0, 20, 64)]
    rank1 = [_step(99.0, 10**9, 7), _step(1.5, 40, 64), _step(1.0, 50, 64), _step(1.0, 60, 64)]
    s = report.run_summary(_result([rank0, rank1]), warmup=1)
    assert s["step_s"] == 2.0  # per step the slowest rank: [1.5, 3.0, 2.0] -> median 2.0
    assert s["act_bytes"] == 50  # per rank medians 20 and 50 -> worst rank
    assert s["a2a_bytes"] == 64
    assert s["process_peak_bytes"] == 501
    assert s["other_comm_bytes"] == 1000.0
    with pytest.raises(ValueError, match="no measured steps"):
        report.run_summary(_result([rank0[:1]]), warmup=1)


def _run(impl, sp, seq, step_s, act, a2a, status="ok"):
    spec = {"impl": impl, "sp": sp, "seq_len": seq, "dtype": "fp32", "model": MODEL}
    steps = [_step(step_s, act, a2a)] * 3
    return {"spec": spec, "status": status, "summary": report.run_summary(_result([steps] * max(sp, 1)), 1)}


def test_cell_rows_medians_and_ratios():
    theory = report.theory_bytes_per_step(8, 8, 32, 2, 2048, 2, 4)
    runs = [
        _run("none", 1, 2048, 4.0, 1000, 0),
        _run("hf_longctx", 2, 2048, 2.0, 400, theory),
        _run("hf_longctx", 2, 2048, 4.0, 600, theory),
        _run("upstream", 2, 2048, 4.0, 500, 1.5 * theory),
        _run("upstream", 2, 2048, 4.0, 500, 1.5 * theory),
        _run("upstream", 2, 2048, 100.0, 1, 1, status="timeout"),  # ignored
    ]
    (row,) = report.cell_rows(runs)
    assert (row["sp"], row["seq_len"], row["hf_longctx_repeats"], row["upstream_repeats"]) == (2, 2048, 2, 2)
    assert row["theory_bytes"] == pytest.approx(theory)
    assert row["hf_longctx"]["step_s"] == 3.0  # median of repeats (2.0, 4.0)
    assert row["ratio"]["step_s"] == pytest.approx(0.75)
    assert row["bytes_vs_theory"] == {"hf_longctx": pytest.approx(1.0), "upstream": pytest.approx(1.5)}
    assert row["act_vs_sp1"] == {"hf_longctx": pytest.approx(0.5), "upstream": pytest.approx(0.5)}
    assert row["sp1"]["step_s"] == 4.0
    (base,) = report.baseline_rows(runs)
    assert (base["seq_len"], base["act_bytes"]) == (2048, 1000)

    head = report.headline([row], min_seq=2048)
    assert head["step_ratio_long"] == {"m/sp2/S2K": pytest.approx(0.75)}
    assert head["bytes_vs_theory_max"]["upstream"] == {"m/sp2": pytest.approx(1.5)}


def test_cell_rows_missing_implementation_gives_none_ratios():
    (row,) = report.cell_rows([_run("hf_longctx", 4, 4096, 1.0, 10, 5)])
    assert row["upstream"] is None and row["sp1"] is None
    assert row["ratio"]["step_s"] is None and row["act_vs_sp1"]["hf_longctx"] is None


def test_render_markdown_tables():
    runs = [_run("none", 1, 8192, 4.0, 2**30, 0), _run("hf_longctx", 4, 8192, 1.0, 2**28, 2**20)]
    runs.append(_run("upstream", 4, 8192, 2.0, 2**28, 2**20))
    meta = {"profile": "cpu", "date": "2026-01-01", "command": "python -m benchmarks.run", "total_wall_s": 12.0}
    md = report.render_markdown(meta, report.cell_rows(runs), report.baseline_rows(runs))
    assert "`python -m benchmarks.run`" in md and "total 12 s" in md
    assert "| 4 | 8K | 1.00 | 2.00 | 0.500 |" in md  # step time row: hf, upstream, ratio
    assert "| 4 | 8K | 256 | 256 | 1024 | 0.250 | 0.250 | 1.000 |" in md  # act MiB and ratios
    assert "| 8K | 4.00 | 1024 |" in md  # SP=1 baseline
    assert "n/a" not in md.split("### SP=1")[0].split("### all_to_all")[0]


def test_plan_alternates_order_and_puts_baselines_first():
    profile = dict(PROFILES["cpu"], cells=[(2, 1024), (4, 1024)], sp1_seq_lens=[1024], repeats=2)
    specs = plan(profile)
    assert [(s["impl"], s["sp"]) for s in specs] == [
        ("none", 1),
        ("hf_longctx", 2),
        ("upstream", 2),
        ("upstream", 2),
        ("hf_longctx", 2),
        ("hf_longctx", 4),
        ("upstream", 4),
        ("upstream", 4),
        ("hf_longctx", 4),
    ]
    spec = make_spec(PROFILES["cpu"], "tiny-llama", "upstream", 4, 2048)
    assert spec["model"]["heads"] % 4 == 0 and spec["model"]["kv_heads"] % 4 == 0
    assert spec["model"]["max_positions"] == 2048 and spec["threads"] == 1


def test_op_category_matches_forward_ops_and_autograd_nodes():
    assert _measure.op_category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert _measure.op_category("ScaledDotProductFlashAttentionForCpuBackward0") == "attention"
    assert _measure.op_category("aten::mm") == "matmul"
    assert _measure.op_category("MmBackward0") is None  # the autograd node itself; its aten::mm child is matmul
    for name in ("_AllToAll", "_AllToAllBackward", "deepspeed::dim_zero_all_to_all", "c10d::allreduce_", "_AllGather"):
        assert _measure.op_category(name) == "communication", name
    assert _measure.op_category("aten::copy_") is None


def test_categorize_ops_uses_innermost_classified_ancestor():
    events = [
        (0.5, ["aten::_scaled_dot_product_flash_attention_for_cpu"]),
        (0.2, ["aten::mm", "aten::linear"]),
        (0.1, ["aten::copy_", "aten::contiguous", "_AllToAll"]),  # a layout copy inside the exchange
        (0.05, ["aten::copy_", "aten::contiguous"]),  # outside any classified op
        (0.01, ["aten::mm", "_AllToAll"]),  # innermost classified name wins
    ]
    out = _measure.categorize_ops(events)
    assert out == pytest.approx({"attention": 0.5, "matmul": 0.21, "communication": 0.1, "other": 0.05, "total": 0.86})


def test_profiled_step_columns_and_floor():
    def run_with_ops(impl, attention, matmul, comm, other):
        run = _run(impl, 2, 8192, 1.0, 10, 5)
        profile = {"attention": attention, "matmul": matmul, "communication": comm, "other": other}
        profile["total"] = sum(profile.values())
        result = _result([[_step(1.0, 10, 5)] * 3] * 2)
        for rank in result["ranks"]:
            rank["op_profile"] = profile
        run["summary"] = report.run_summary(result, 1)
        return run

    (row,) = report.cell_rows([run_with_ops("hf_longctx", 6, 2, 1, 1), run_with_ops("upstream", 6, 2, 0.5, 1.5)])
    assert row["hf_longctx"]["ops_total_s"] == 10 and row["ratio"]["ops_total_s"] == pytest.approx(1.0)
    assert report.floor_ratio(row) == pytest.approx(0.8)  # (6 + 2) / 10
    assert report.no_comm_ratio(row) == pytest.approx(0.9)  # (10 - 1) / 10
    assert report.headline([row])["step_ratio_floor_long"] == {"m/sp2/S8K": pytest.approx(0.8)}
    md = report.render_markdown({}, [row], [])
    assert "### Where the time goes" in md and "| 0.900 | 0.800 |" in md
    # without profiled steps (GPU profile) the section is left out
    md = report.render_markdown({}, report.cell_rows([_run("hf_longctx", 2, 8192, 1.0, 10, 5)]), [])
    assert "### Where the time goes" not in md


# ---- benchmarks/gpu_check.py: a SKIP is not a pass ---------------------------------------------------------------


def _cell(kernel, status, **extra):
    return {"kernel": kernel, "dtype": "bfloat16", "sp": 2, "status": status, **extra}


def test_gpu_check_verdict_fails_on_unexpected_skips_and_errors():
    from benchmarks.gpu_check import verdict

    assert verdict([_cell("sdpa", "PASS"), _cell("flex_attention", "SKIP", expected=True)])[0]
    ok, line = verdict([_cell("sdpa", "PASS"), _cell("flash_attention_2", "SKIP")])
    assert not ok and "flash_attention_2 bfloat16 SP=2 SKIP" in line and line.startswith("gpu_check: FAIL")
    assert not verdict([_cell("flash_attention_2", "ERROR", error="flash row refused")])[0]
    assert not verdict([_cell("sdpa", "FAIL")])[0]


def test_gpu_check_matrix_skips_are_expected_only_on_cpu_or_when_asked(monkeypatch, tmp_path):
    from benchmarks import gpu_check

    jobs = []
    monkeypatch.setattr(
        gpu_check, "run_job", lambda attn, backend, n, device, log: jobs.append(backend) or [_cell(attn, "PASS")]
    )
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)  # no flash-attn installed
    cpu = gpu_check.matrix("cpu", tmp_path)
    assert {r["kernel"] for r in cpu if r["status"] == "SKIP"} == {"flash_attention_2", "flex_attention"}
    assert gpu_check.verdict(cpu)[0]  # the CPU dry run cannot run them: expected
    assert sorted(jobs) == ["hybrid", "ring", "ulysses", "ulysses"]  # every backend has its job
    cuda = gpu_check.matrix("cuda", tmp_path)
    assert [r["kernel"] for r in cuda if r["status"] == "SKIP"] == ["flash_attention_2"]
    assert not gpu_check.verdict(cuda)[0]  # on CUDA a missing flash-attn fails the check ...
    assert gpu_check.verdict(gpu_check.matrix("cuda", tmp_path, frozenset({"flash_attention_2"})))[
        0
    ]  # ... unless asked


def test_gpu_check_dry_run_verdict_from_saved_rows(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"rows": [_cell("sdpa", "PASS"), _cell("flash_attention_2", "SKIP")]}))
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--cpu-dry-run", "--from-json", str(saved)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "gpu_check: FAIL" in proc.stdout, proc.stdout + proc.stderr


def test_object_census_counts_a_held_tensor_and_leaves_out_the_records():
    import torch

    records: list[dict] = []
    before = _measure.object_census([records])
    held = [torch.zeros(1000)]
    records.append({"kept": [[i] for i in range(5000)]})  # the run's own records: not counted
    after = _measure.object_census([records])
    assert after["tensors"] == before["tensors"] + 1
    assert after["tensor_bytes"] == before["tensor_bytes"] + held[0].untyped_storage().nbytes()
    # The 5,001 containers under `records` are what separates a census that leaves them out from one that counts them.
    assert _measure.object_census()["objects"] - _measure.object_census([records])["objects"] >= 5001
    del held
    assert _measure.object_census([records])["tensors"] == before["tensors"]


def test_census_growth_compares_whole_epochs_and_sees_one_leaked_object():
    from benchmarks.drift import census_growth

    def samples(counts: list[int]) -> list[dict]:
        return [{"tensors": c, "tensor_bytes": 8 * c, "objects": 10 * c} for c in counts]

    periodic = [5, 5, 7] * 8  # a boundary every third step: the highest count repeats with the epoch
    assert census_growth(samples(periodic), epoch=3) == {"tensors": [7, 7], "tensor_bytes": [56, 56],
                                                          "objects": [70, 70]}  # fmt: skip
    leaked = periodic[:-5] + [c + 1 for c in periodic[-5:]]
    assert census_growth(samples(leaked), epoch=3)["tensors"] == [7, 8]
    assert census_growth(samples(periodic[:5]), epoch=3) is None  # fewer than two epochs
    assert census_growth([{"rss_mib": 1.0}] * 10, epoch=3) is None  # a run without a census

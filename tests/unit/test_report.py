"""`hf_longctx.instrument.curves`: the loss-curve comparison the main job prints and plots."""

from __future__ import annotations

import json

import pytest

from hf_longctx.instrument.curves import compare_runs, plot_loss_curves


def _run(tmp_path, name: str, losses: list[float]) -> str:
    folder = tmp_path / name
    folder.mkdir()
    history = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)] + [{"step": len(losses), "train_runtime": 1}]
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    return str(folder)


def test_compare_runs_and_plot_with_difference_panel(tmp_path):
    run = _run(tmp_path, "sp2", [2.0, 1.5, 1.0])
    ref = _run(tmp_path, "sp1", [2.0, 1.5 * (1 + 3e-7), 1.0])
    worst, steps = compare_runs(run, ref)
    assert steps == 3
    assert worst == pytest.approx(3e-7 / (1 + 3e-7), rel=1e-6)
    png = plot_loss_curves({"SP=2": run, "reference": ref}, str(tmp_path / "curves.png"))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png == str(tmp_path / "curves.png")


def test_runs_without_common_steps_raise(tmp_path):
    with pytest.raises(ValueError, match="no logged step in common"):
        compare_runs(_run(tmp_path, "a", [1.0]), str(_run(tmp_path, "b", [])))

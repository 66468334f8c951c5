"""`benchmarks.plan_validate --tiled`: a grid of tiled_layer points that measures once the flag exists and
refuses, measuring nothing, until then."""

from __future__ import annotations

import pytest

from benchmarks import plan_validate


def _tiled(point: dict) -> bool:
    return "tiled_layer" in point.get("flags", {})


def test_the_tiled_grid_has_six_points_the_planner_models():
    tiled = [p for p in plan_validate.TILED_POINTS if _tiled(p)]
    assert len(tiled) >= 6
    for point in tiled:
        assert plan_validate.run_config(point).tiled_layer == point["flags"]["tiled_layer"]
        assert plan_validate.worker_spec(point)["sp_options"]["tiled_layer"] == point["flags"]["tiled_layer"]
        assert plan_validate.predict(point, 0.05).peak_gib > 0
    names = {p["name"] for p in plan_validate.TILED_POINTS}
    assert all(p["vs"] in names for p in tiled if "vs" in p)


def test_tiled_refuses_without_the_flag_and_measures_nothing(monkeypatch, capsys):
    monkeypatch.setattr(plan_validate, "tiled_layer_available", lambda: False)
    monkeypatch.setattr(plan_validate, "measure", lambda point, timeout: pytest.fail(f"measured {point['name']}"))
    assert plan_validate.main(["--tiled", "--no-write"]) == 2
    assert "tiled_layer is not in ParallelismConfig" in capsys.readouterr().err


def test_tiled_measures_every_point_once_the_flag_exists(monkeypatch, capsys):
    seen = []

    def fake(point, timeout):
        seen.append(point)
        peak = plan_validate.predict(point, 0.05).peak_gib
        return {"measured_gib": peak, "per_rank_gib": [peak]}

    monkeypatch.setattr(plan_validate, "tiled_layer_available", lambda: True)
    monkeypatch.setattr(plan_validate, "measure", fake)
    assert plan_validate.main(["--tiled", "--no-write"]) == 0
    assert [p["name"] for p in seen] == [plan_validate.CALIBRATION["name"]] + [
        p["name"] for p in plan_validate.TILED_POINTS
    ]
    assert "sp1-s32768-all-flags-tiled-layer16 / sp1-s32768-all-flags: measured" in capsys.readouterr().out

"""`benchmarks.plan_validate --tiled`: a grid of at least six tiled_layer points the planner models, each measured
once (the calibration point first)."""

from __future__ import annotations

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


def test_tiled_measures_every_point(monkeypatch, capsys):
    seen = []

    def fake(point, timeout):
        seen.append(point)
        peak = plan_validate.predict(point, 0.05).peak_gib
        return {"measured_gib": peak, "per_rank_gib": [peak]}

    monkeypatch.setattr(plan_validate, "measure", fake)
    assert plan_validate.main(["--tiled", "--no-write"]) == 0
    assert [p["name"] for p in seen] == [plan_validate.CALIBRATION["name"]] + [
        p["name"] for p in plan_validate.TILED_POINTS
    ]
    assert "sp1-s8192-all-flags-tiled-layer8 / sp1-s8192-all-flags: measured" in capsys.readouterr().out

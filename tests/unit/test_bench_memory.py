"""`python -m benchmarks.memory --from-json`: medians, target ratios and the ladder from synthetic run records.

The benchmark runs as a command (tests do not import benchmarks) on a saved file of made-up records; the test
reads the page and the summary it writes back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def _record(cell, variant, seq_len, step_times, peaks, warmup=1, status="ok", loss=1.0, ref=None):
    spec = {"cell": cell, "variant": variant, "seq_len": seq_len, "warmup": warmup}
    record = {"spec": spec, "label": f"{cell} {variant} S={seq_len}", "status": status}
    if status != "ok":
        return record
    ranks = [{"steps": [{"step_s": t * (1 + r / 10), "cpu_s": t} for t in step_times], "process_peak_bytes": p * GiB,
              "first_loss": loss, "document_reference_loss": ref} for r, p in enumerate(peaks)]  # fmt: skip
    return {**record, "result": {"ranks": ranks}}


def _summary(tmp_path, records):
    meta = {"args": {"budget_gib": 2.0, "seq_len": 16384, "doc_len": 1024, "max_seq": 65536}, "model": {}}
    meta.update(date="d", command="python -m benchmarks.memory", total_wall_s=60.0, load_start="1.0", cpus=2)
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": dict(meta, flags={"tiled_loss": True}), "records": records}))
    cmd = [sys.executable, "-m", "benchmarks.memory", "--from-json", str(saved), "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "out.json").read_text())["summary"], (tmp_path / "out.md").read_text()


def test_summary_medians_ratios_and_ladder(tmp_path):
    records = [
        # warm-up step (first) excluded; slowest rank (rank 1 = x1.1) per step; median over steps then repeats
        _record("trainer", "off", 16384, [9.0, 10.0, 12.0], [3.0, 3.1]),
        _record("trainer", "off", 16384, [9.0, 10.0, 10.0], [3.0, 3.0]),
        _record("trainer", "flags", 16384, [9.0, 11.0, 11.0], [1.0, 1.2]),
        _record("trainer", "upstream", 16384, [9.0, 20.0, 20.0], [4.0, 4.0]),
        _record("packed", "off", 16384, [1.0, 2.0], [1.0, 1.0], loss=5.0, ref=5.0),
        _record("packed", "flags", 16384, [1.0, 3.0], [0.5, 0.5], loss=5.0, ref=5.0),
        _record("packed", "upstream", 16384, [1.0, 8.0], [2.0, 2.0], loss=4.0, ref=5.0),
        _record("longest", "upstream", 4096, [5.0], [1.5], warmup=0),
        _record("longest", "upstream", 8192, [5.0], [2.5], warmup=0),
        _record("longest", "flags", 16384, [5.0], [1.2], warmup=0),
        _record("longest", "flags", 32768, [5.0], [1.9], warmup=0),
        _record("longest", "flags", 65536, [5.0], [1.0], warmup=0, status="timeout"),
    ]
    summary, text = _summary(tmp_path, records)
    (off,) = [r for r in summary["rows"] if (r["cell"], r["variant"]) == ("trainer", "off")]
    assert off["runs"] == 2 and off["peak_gib"] == (3.1 + 3.0) / 2
    assert abs(off["step_s"] - (11.0 * 1.1 + 11.0) / 2) < 1e-9  # run medians 12.1 (11*1.1) and 11.0
    ratios = summary["ratios"]
    assert abs(ratios["trainer_peak_flags_over_upstream"] - 1.2 / 4.0) < 1e-9
    assert abs(ratios["packed_time_over_upstream"] - 0.25) < 1e-9
    assert abs(ratios["packed_flags_time_over_upstream"] - 3.0 / 8.0) < 1e-9
    assert ratios["packed_flags_peak_over_upstream"] == 0.25
    assert summary["longest"] == {"upstream": 4096, "flags": 32768}
    assert ratios["longest_ours_over_upstream"] == 8.0
    assert ratios["sft_peak_flags_over_upstream"] is None
    assert summary["failures"] == ["longest flags S=65536: timeout"]
    assert "trainer_peak_flags_over_upstream: 0.3000 (target <= 0.35: reached)" in text
    assert "packed_peak_over_upstream: 0.5000 (target <= 1.0: reached)" in text
    assert "packed_flags_peak_over_upstream: 0.2500 (target <= 1.0: reached)" in text
    assert "| hf_longctx, flags | 0.500 |" in text
    assert "sft_time_flags_over_off" not in text  # not measured: left out

"""Run every bad-input scenario of tests/dist/test_bad_inputs.py as its own 2-rank job, back to back, and say how
each rank ended: a clear ValueError, another error (which), a hang, or success.

    python scripts/bad_input_sweep.py --rounds 3 --timeout 90 --out /tmp/sweep.jsonl

Times are seconds from the launch: when each rank entered the scenario (start-up: forkserver, imports,
process group) and when it raised or exited. The load average is printed with each job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import _faults  # noqa: E402
from tests.dist.test_bad_inputs import single_case_worker  # noqa: E402

CASES = (
    "vocab_high",
    "vocab_negative",
    "too_long",
    "mask_shape",
    "empty_batch",
    "trainer_vocab",
    "trainer_empty_train_sequential",
    "trainer_empty_train_random",
    "trainer_empty_eval",
)


def _last_line(error: str | None) -> str | None:
    return None if error is None else error.strip().splitlines()[-1][:300]


def run_case(name: str, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        t0 = time.time()
        outcomes = _faults.launch(single_case_worker, 2, out_dir, name, timeout=timeout)
        starts = []
        for rank in range(2):
            marker = Path(out_dir, f"start-rank{rank}")
            starts.append(float(marker.read_text()) - t0 if marker.exists() else None)
    ranks = []
    for o in outcomes:
        last = _last_line(o.error)
        ranks.append(
            {
                "rank": o.rank,
                "exitcode": o.exitcode,
                "hung": o.hung,
                "start_s": starts[o.rank],
                "error_s": None if o.error_time is None else o.error_time - t0,
                "exit_s": None if o.exit_time is None else o.exit_time - t0,
                "last": last,
                "clear": bool(last and last.startswith("ValueError")),
                "error": o.error if o.error and not (last or "").startswith("ValueError") else None,
            }
        )
    return {"case": name, "load": os.getloadavg()[0], "clear_on_both": all(r["clear"] for r in ranks), "ranks": ranks}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bad = 0
    for round_ in range(args.rounds):
        for name in args.cases:
            row = {"round": round_, **run_case(name, args.timeout)}
            bad += not row["clear_on_both"]
            short = [
                (
                    r["rank"],
                    r["start_s"] and round(r["start_s"], 1),
                    r["error_s"] and round(r["error_s"], 1),
                    r["hung"],
                    r["last"],
                )
                for r in row["ranks"]
            ]
            print(f"{round_} {name} load={row['load']:.1f} clear={row['clear_on_both']} {short}", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"not clear on both ranks: {bad}", flush=True)
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())

"""How fast the torch-free entry points answer: `import hf_longctx.planner` and `hf-longctx --help`.

    python -m benchmarks.cli_speed [--runs 5]

Medians of fresh interpreters; targets: import < 1 s, `--help` < 1.5 s (exit 1 when one is missed). Method:
benchmarks/README.md ("CLI start-up").
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_TARGET_S, HELP_TARGET_S = 1.0, 1.5


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def import_times(module: str) -> tuple[float, float]:
    """(`module`'s cumulative import, all top-level imports of the process) in seconds, from -X importtime."""
    cmd = [sys.executable, "-X", "importtime", "-c", f"import {module}"]
    err = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, check=True).stderr
    own, total = 0.0, 0.0
    for line in err.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        if not name.startswith("  "):  # a top-level import of the process (nested ones are indented)
            total += int(cumulative) / 1e6
            if name.strip() in (module, module.split(".")[0]):
                own += int(cumulative) / 1e6
    return own, total


def wall_time(args: list[str]) -> float:
    """Seconds `python -m hf_longctx.cli ARGS` takes from start to exit."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "hf_longctx.cli", *args], cwd=ROOT, env=_env(), capture_output=True, check=True
    )
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    imports = [import_times("hf_longctx.planner") for _ in range(runs)]
    rows = [("import hf_longctx.planner (cumulative)", statistics.median(i[0] for i in imports), IMPORT_TARGET_S),
            ("  every import of that process", statistics.median(i[1] for i in imports), None)]  # fmt: skip
    for args in (["--help"], ["plan", "--help"]):
        wall = statistics.median(wall_time(args) for _ in range(runs))
        rows.append((f"hf-longctx {' '.join(args)} (wall)", wall, HELP_TARGET_S))
    print(f"median of {runs} fresh interpreters ({sys.executable})")
    for label, seconds, target in rows:
        verdict = "" if target is None else ("  ok" if seconds < target else "  SLOW") + f" (target < {target} s)"
        print(f"  {label:40s} {seconds:7.3f} s{verdict}")
    return 1 if any(target is not None and seconds >= target for _, seconds, target in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

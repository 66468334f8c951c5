"""Run every GPU test (tests/gpu) in its own process: a CUDA fault poisons only the process it happens in.

    python scripts/gpu_tests.py --out DIR [--parallel 7] [--expect-skip REGEX]

Kernel tests run `--parallel` at a time; beside them the memory tests (tests/gpu/test_memory_gpu.py: 16 GiB and
more each) run one at a time in a lane of their own. The kernel-matrix test is left out (`benchmarks.gpu_check` is
that matrix, run by scripts/gpu_check.sh). Writes DIR/gpu-tests.log (a line per test, as it ends) and
DIR/gpu-tests-failures.log (each failure's tail). Exit 0 only when every test passed; a skip fails unless its id
matches `--expect-skip`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERIAL = "tests/gpu/test_memory_gpu.py"
LEFT_OUT = "tests/gpu/test_kernels_gpu.py"


def collect() -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu",
           f"--ignore={LEFT_OUT}"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


def run_one(test_id: str, timeout: float) -> tuple[str, str, float, str]:
    """(test id, PASS / FAIL / SKIP / TIMEOUT, seconds, output tail)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test_id]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return test_id, "TIMEOUT", time.monotonic() - started, str(exc.stdout or "")[-4000:]
    tail = (proc.stdout + proc.stderr)[-6000:]
    status = "PASS" if proc.returncode == 0 and " passed" in tail else "SKIP" if " skipped" in tail else "FAIL"
    return test_id, status, time.monotonic() - started, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parallel", type=int, default=7, help="kernel tests at a time (the memory lane is one more)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per test")
    parser.add_argument("--expect-skip", default="^$", help="regex of test ids whose skip is accepted")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    ids = collect()
    if not ids:
        print("gpu_tests: no GPU test collected")
        return 1
    lock, results = threading.Lock(), []
    log = open(args.out / "gpu-tests.log", "a", buffering=1)

    def record(result: tuple[str, str, float, str]) -> None:
        test_id, status, seconds, tail = result
        line = f"{time.strftime('%H:%M:%S')} {status:7s} {seconds:6.1f} s {test_id}"
        with lock:
            results.append(result)
            print(line, flush=True)
            log.write(line + "\n")
            if status != "PASS":
                with open(args.out / "gpu-tests-failures.log", "a") as f:
                    f.write(f"\n\n######## {test_id} ({status})\n{tail}")

    parallel = [t for t in ids if not t.startswith(SERIAL)]
    serial = [t for t in ids if t.startswith(SERIAL)]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    print(f"gpu_tests: {len(parallel)} tests {args.parallel} at a time, beside them {len(serial)} one by one ({gpus})")

    def serial_lane() -> None:
        for test_id in serial:
            record(run_one(test_id, args.timeout))

    lane = threading.Thread(target=serial_lane)
    lane.start()
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        for done in concurrent.futures.as_completed([pool.submit(run_one, t, args.timeout) for t in parallel]):
            record(done.result())
    lane.join()
    accepted = re.compile(args.expect_skip)
    bad = [r for r in results if r[1] != "PASS" and not (r[1] == "SKIP" and accepted.search(r[0]))]
    line = f"gpu_tests: {len(results) - len(bad)} of {len(results)} passed, each in its own process"
    print(line + (f"; failed: {', '.join(r[0] for r in bad)}" if bad else ""))
    log.write(line + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""The planner and the command line's parsing import no torch, transformers or accelerate.

Each case runs in a fresh interpreter (this process has torch loaded already), so `sys.modules` there
shows exactly what the entry point pulled in: the robust form of "`hf-longctx plan` answers in well
under a second" (`python -m benchmarks.cli_speed` prints the times).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "accelerate", "deepspeed", "trl")
CLI = """import runpy, sys
sys.argv = ["hf-longctx", *{argv!r}]
try:
    runpy.run_module("hf_longctx.cli", run_name="__main__")
except SystemExit:
    pass"""


def _heavy_modules_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_planner_imports_no_torch():
    assert _heavy_modules_after("import hf_longctx.planner\nimport hf_longctx.cli.plan") == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["plan", "--help"],
        ["check", "--help"],
        ["plan", "--model", "qwen3-4b", "--seq-len", "8192"],
        ["plan", "--model", "qwen3-4b", "--seq-len", "1048576", "--world", "8"],  # does not fit: the search runs
    ],
)
def test_cli_help_and_plan_import_no_torch(argv):
    assert _heavy_modules_after(CLI.format(argv=argv)) == []

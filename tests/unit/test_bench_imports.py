"""Benchmarks and tests stay apart: no benchmark imports a test helper, and no test of hf_longctx runs a
benchmark's code as its own (a test that needs a benchmark runs it as a command).

The only tests that import `benchmarks` are the unit tests of the benchmarks' pure functions (their subject is
that code); a test that needs a whole benchmark runs it as a command (`tests/dist/test_drift.py`,
`tests/dist/test_planner_cpu.py`, `tests/unit/test_bench_memory.py` on saved records with `--from-json`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARK_UNIT_TESTS = {
    "tests/unit/test_bench_report.py",
    "tests/unit/test_gpu_ladder.py",
    "tests/unit/test_planner_published.py",
    "tests/unit/test_planner.py",
    "tests/unit/test_plan_validate_tiled.py",
}


def imported_roots(path: Path) -> set[str]:
    """Top-level packages a file imports (module level or inside functions; relative imports excluded)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def _files(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imported_roots(p) for p in sorted((ROOT / folder).rglob("*.py"))}


def test_benchmarks_import_no_test_helper():
    offenders = [name for name, roots in _files("benchmarks").items() if "tests" in roots]
    assert offenders == [], offenders


def test_tests_do_not_use_benchmarks_as_a_library():
    importing = {name for name, roots in _files("tests").items() if "benchmarks" in roots}
    assert importing - BENCHMARK_UNIT_TESTS == set()


def test_the_walk_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "x.py"
    source.write_text("import os\n\ndef f():\n    from tests._dist import run\n    import benchmarks.run\n")
    assert imported_roots(source) == {"os", "tests", "benchmarks"}

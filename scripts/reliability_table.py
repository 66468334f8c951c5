"""Run the fault, resume and bad-input tests and print docs/reliability.md's table from what they measured.

    python scripts/reliability_table.py   # ~3-5 min on 2 cores: benchmarks/results/<date>-reliability.{json,md}
    python scripts/reliability_table.py --from-json benchmarks/results/<date>-reliability.json   # re-render

The tests record what they measured with pytest's `record_property` (timings, and an `outcome`: exit codes, the
peer failure each survivor saw, the collective rank 0 named, the worst relative difference after a resume);
this script runs them with `--junitxml`, keeps every test's properties in the JSON and renders one row per
fault from them: what was injected, what happened, how long the survivors took to exit, and what was lost. A
test that failed shows as FAILED, one that recorded nothing as "not measured". It exits non-zero if any of the
tests failed.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/dist/test_faults.py", "tests/dist/test_bad_inputs.py", "tests/dist/test_resume_layout.py"]
LAYOUTS = {"sp2": "SP=2 (world 2)", "dp2_sp2": "DP=2 x SP=2 (world 4)"}
PHASES = {"forward": "the forward", "backward": "the backward", "optimizer": "the optimizer step"}
LOST = "step 3 (in progress); restart from checkpoint-2 redoes it: steps 3-5 bitwise equal, same rows"
# The torchrun and hang runs are not restarted; their checkpoint-2 is checked byte for byte against the others'.
SAME_CHECKPOINT = "step 3 (in progress); checkpoint-2 byte-identical to the runs above"


def run_tests(xml: Path) -> tuple[int, dict[str, dict[str, object]]]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *TESTS]
    code = subprocess.run(cmd, cwd=ROOT, check=False).returncode
    props: dict[str, dict[str, object]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        failed = any(child.tag in ("failure", "error") for child in case)
        entry: dict[str, object] = {"failed": failed}
        for prop in case.iter("property"):
            try:
                entry[prop.get("name")] = ast.literal_eval(prop.get("value"))
            except (ValueError, SyntaxError):
                entry[prop.get("name")] = prop.get("value")
        props[case.get("name")] = entry
    return code, props


def _seconds(values: object) -> str:
    if isinstance(values, dict):
        values = list(values.values())
    if isinstance(values, (int, float)):
        values = [values]
    return f"{max(values):.2f} s" if values else "n/a"


def outcome(case: dict[str, object] | None, render) -> str:
    """The outcome cell: `render(what the test recorded)`; FAILED / not run / not measured otherwise."""
    if case is None:
        return "not run"
    if case.get("failed"):
        return "**FAILED** (see the test log)"
    observed = case.get("outcome")
    if observed is None:
        return "not measured (the test recorded no outcome)"
    return render(observed)


def _killed(o: dict) -> str:
    codes, seen = ", ".join(map(str, o["exit_codes"])), "; ".join(f"`{m}`" for m in o["peer_failures"])
    return (f"{o['survivors']} survivor(s) exit with code {codes} on a peer failure ({seen}); "
            f"rank 0 (same SP group) names {o['rank0_names']}")  # fmt: skip


def _resume(diff: object) -> str:
    return f"steps 3-5 equal the uninterrupted SP=2 run (max relative difference {diff:.1e}), same rows"


def _merge(cases: list[dict[str, object] | None], key: str) -> dict[str, object] | None:
    """One case for several parametrized tests: failed if any failed, the worst `key` as its outcome."""
    found = [c for c in cases if c is not None]
    if not found:
        return None
    values = [c[key] for c in found if key in c]
    return {"failed": any(c["failed"] for c in found), **({"outcome": max(values)} if values else {})}


def _errors(cases: list[dict[str, object]]) -> dict[str, object] | None:
    """The bad-input tests as one case: the error each scenario raised (one message on every rank)."""
    if not cases:
        return None
    found = [
        f"{name}: `{' / '.join(m[:50] for m in msgs)}...`" for c in cases for name, msgs in c.get("errors", {}).items()
    ]
    return {"failed": any(c["failed"] for c in cases), **({"outcome": found} if found else {})}


def rows(props: dict[str, dict[str, object]]) -> list[tuple[str, str, str, str]]:
    out = []
    for layout, label in LAYOUTS.items():
        for phase, where in PHASES.items():
            case = props.get(f"test_killed_rank_ends_every_survivor_fast_with_a_peer_failure[{layout}-{phase}]")
            fault = f"SIGKILL rank 1 in {where} of step 3, {label}"
            out.append((fault, outcome(case, _killed), _seconds((case or {}).get("seconds_to_exit", [])), LOST))
    case = props.get("test_torchrun_stops_the_job_and_names_the_dead_rank")
    out.append((
        "SIGKILL rank 1 in the forward, SP=2 under `torchrun`",
        outcome(case, lambda o: f"torchrun's summary names {', '.join(f'`{n}`' for n in o['summary_names'])}; it "
                                f"stops rank 0; {o['processes_left']} processes left"),
        _seconds((case or {}).get("seconds_to_exit", [])) + " (launcher exit)",
        SAME_CHECKPOINT,
    ))  # fmt: skip
    case = props.get("test_frozen_rank_ends_its_peer_after_the_timeout")
    out.append((
        "SIGSTOP rank 1 in the forward (a hang), SP=2, `ddp_timeout=3`",
        outcome(case, lambda o: f"rank 0 raises `CollectiveError` after the {o['timeout']}: `{o['rank0_error']}`"),
        _seconds((case or {}).get("seconds_to_error", [])),
        SAME_CHECKPOINT,
    ))  # fmt: skip
    for engine, name in (("ddp", "DDP"), ("zero3", "ZeRO-3, universal checkpoint")):
        names = [
            f"test_checkpoint_from_sp2_resumes_at_another_sp_size[{sp}-{engine}]" for sp in ("sp4_world4", "sp1_world1")
        ]
        case = _merge([props.get(n) for n in names], "max_rel_diff")
        fault = f"job restarted at another SP size: checkpoint-2 of SP=2 resumed at SP=4 (world 4) and SP=1 ({name})"
        out.append((fault, outcome(case, _resume), "-", "the steps since the checkpoint, redone"))
    bad = [v for k, v in props.items() if k.startswith("test_bad_input_raises_on_every_rank")]
    out.append((
        "bad input: token id >= vocab or < 0, position >= the model's limit, mask/ids shape mismatch, "
        "empty batch / dataset",
        outcome(_errors(bad), lambda o: f"on every SP rank, before any attention collective: {'; '.join(o)}"),
        _seconds([v.get("seconds", 0.0) for v in bad]) + " (to the error, building the Trainer included)",
        "nothing: no step ran",
    ))  # fmt: skip
    case = props.get("test_window_without_labels_gives_zero_loss_and_gradients")
    window = lambda o: f"loss {o['loss']}, gradient norm {o['grad_norm']} on all {o['ranks']} ranks; training continues"  # noqa: E731
    out.append(("a gradient-accumulation window without any label", outcome(case, window), "-", "nothing"))
    case = props.get("test_resume_that_changes_the_global_batch_is_refused_on_every_rank")
    out.append((
        "resume with another DP size (global batch 4 -> 8)",
        outcome(case, lambda o: f"refused on all {o['ranks_refused']} ranks: `{o['error']}...`"),
        "-",
        "nothing: refused before the first step",
    ))  # fmt: skip
    return out


def markdown(table: list[tuple[str, str, str, str]], failed: list[str]) -> str:
    lines = [
        f"# Reliability ({datetime.date.today().isoformat()}): `python scripts/reliability_table.py`",
        "",
        "| fault injected | outcome | time to exit | what was lost |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table]
    lines += ["", "Failed tests: " + (", ".join(failed) if failed else "none"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-json", type=Path, help="re-render the table from a saved <date>-reliability.json")
    args = parser.parse_args(argv)
    stem = ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-reliability"
    if args.from_json:
        code, props, stem = 0, json.loads(args.from_json.read_text())["tests"], args.from_json.with_suffix("")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            code, props = run_tests(Path(tmp) / "junit.xml")
        stem.with_suffix(".json").write_text(json.dumps({"exit_code": code, "tests": props}, indent=1) + "\n")
    failed = [name for name, entry in props.items() if entry["failed"]]
    text = markdown(rows(props), failed)
    stem.with_suffix(".md").write_text(text)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())

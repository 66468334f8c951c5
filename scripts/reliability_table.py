"""Run the fault, resume and bad-input tests and print the README's reliability table from what they measured.

    python scripts/reliability_table.py     # ~3-5 min on 2 cores; writes benchmarks/results/<date>-reliability.md

The tests record their timings with pytest's `record_property`; this script runs them with `--junitxml` and
turns the properties into one row per fault: what was injected, what happened, how long the survivors took to
exit, and what was lost. It exits non-zero if any of the tests failed.
"""

from __future__ import annotations

import ast
import datetime
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


def rows(props: dict[str, dict[str, object]]) -> list[tuple[str, str, str, str]]:
    out = []
    for layout, label in LAYOUTS.items():
        for phase, where in PHASES.items():
            case = props.get(f"test_killed_rank_ends_every_survivor_fast_with_a_peer_failure[{layout}-{phase}]", {})
            if phase == "optimizer":
                named = "the traceback names the Trainer's `all_gather`"
            else:
                named = "hf_longctx's `CollectiveError` names `all_to_all` over ranks [0, 1]"
            outcome = f"every survivor raises a peer failure; rank 0 (same SP group): {named}"
            fault = f"SIGKILL rank 1 in {where} of step 3, {label}"
            out.append((fault, outcome, _seconds(case.get("seconds_to_exit", [])), LOST))
    case = props.get("test_torchrun_stops_the_job_and_names_the_dead_rank", {})
    out.append(
        (
            "SIGKILL rank 1 in the forward, SP=2 under `torchrun`",
            "torchrun's summary names `rank: 1`, `Signal 9 (SIGKILL)`; it stops rank 0; no process left",
            _seconds(case.get("seconds_to_exit", [])) + " (launcher exit)",
            SAME_CHECKPOINT,
        )
    )
    case = props.get("test_frozen_rank_ends_its_peer_after_the_timeout", {})
    out.append(
        (
            "SIGSTOP rank 1 in the forward (a hang), SP=2, `ddp_timeout=3`",
            "rank 0's `all_to_all` raises `CollectiveError` after the group timeout (3 s), naming ranks [0, 1]",
            _seconds(case.get("seconds_to_error", [])),
            SAME_CHECKPOINT,
        )
    )
    for engine, name in (("ddp", "DDP"), ("zero3", "ZeRO-3, universal checkpoint")):
        diffs = [
            props.get(f"test_checkpoint_from_sp2_resumes_at_another_sp_size[{sp}-{engine}]", {}).get("max_rel_diff")
            for sp in ("sp4_world4", "sp1_world1")
        ]
        worst = max((d for d in diffs if d is not None), default=None)
        shown = f"{worst:.1e}" if worst is not None else "n/a"
        out.append(
            (
                f"job restarted at another SP size: checkpoint-2 of SP=2 resumed at SP=4 (world 4) and SP=1 ({name})",
                f"steps 3-5 equal the uninterrupted SP=2 run (max relative difference {shown}), same rows",
                "-",
                "the steps since the checkpoint, redone",
            )
        )
    bad = [v for k, v in props.items() if k.startswith("test_bad_input_raises_on_every_rank")]
    out.append(
        (
            "bad input: token id >= vocab or < 0, position >= the model's limit, mask/ids shape mismatch, "
            "empty batch / dataset",
            "`ValueError` naming the culprit on every SP rank, before any attention collective",
            _seconds([v.get("seconds", 0.0) for v in bad]) + " (to the error, building the Trainer included)",
            "nothing: no step ran",
        )
    )
    window = ("a gradient-accumulation window without any label", "loss 0, gradients 0, no NaN; training continues")
    out.append((*window, "-", "nothing"))
    out.append(
        (
            "resume with another DP size (global batch 4 -> 8)",
            "refused on every rank: `ValueError` naming gradient_accumulation_steps=1 (or per-device batch 1)",
            "-",
            "nothing: refused before the first step",
        )
    )
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


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        code, props = run_tests(Path(tmp) / "junit.xml")
    failed = [name for name, entry in props.items() if entry["failed"]]
    text = markdown(rows(props), failed)
    out = ROOT / "benchmarks" / "results" / f"{datetime.date.today().isoformat()}-reliability.md"
    out.write_text(text)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())

"""A checkpoint resumes at another SP size with equal later losses; one that changes the global batch is refused.

Source: the uninterrupted SP=2 run at world 2 (DP=1; AdamW, linear decay, gradient accumulation 2, shared with
`test_faults.py`) and its checkpoint after step 2. Copies of that checkpoint resume at SP=4 (world 4) and without
SP (world 1): steps 3-5 must equal the SP=2 run's to float32 round-off (SP is exact, not bitwise). The same on
DeepSpeed ZeRO-3 (CPU) through DeepSpeed's universal checkpoint: ZeRO-3 shards parameters and optimizer state
over the ranks, so the checkpoint saved by 2 ranks is converted (`ds_to_universal`) before 4 or 1 ranks load it.
Resuming at DP=2 x SP=2 (world 4) would double the global batch: refused on every rank with the setting that
keeps it (gradient_accumulation_steps=1), and with that setting the resume equals the run again.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from tests.dist import _fault_jobs as J
from tests.dist import _trainer_utils as U

RTOL = 1e-5
LAUNCH_TIMEOUT_S = 300
RESUMED = slice(2, None)  # steps 3-5: what the resumed run computes itself


def _copy_checkpoint(run_dir: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(Path(run_dir) / "checkpoint-2", dest / "checkpoint-2")
    return dest


def _resume(key, world: int, out: Path, **kwargs) -> list:
    return J.launch_once(key, world, str(out), resume=True, timeout=LAUNCH_TIMEOUT_S, **kwargs)


@pytest.mark.parametrize("zero3", [None, "universal"], ids=["ddp", "zero3"])
@pytest.mark.parametrize("sp", [4, 1], ids=["sp4_world4", "sp1_world1"])
def test_checkpoint_from_sp2_resumes_at_another_sp_size(sp, zero3, tmp_path_factory, record_property):
    source = "native" if zero3 else None
    run_dir, full = J.uninterrupted(2, tmp_path_factory, timeout=LAUNCH_TIMEOUT_S, zero3=source)
    out = _copy_checkpoint(run_dir, tmp_path_factory.mktemp(f"resume_sp{sp}_{zero3}"))
    if zero3:
        J.to_universal(str(out / "checkpoint-2"))
    resumed = J.results(_resume(("resume", sp, zero3), sp, out, sp=sp, zero3=zero3))

    ref = full[0]["logs"]
    worst = 0.0
    for result in resumed:
        assert [h["step"] for h in result["logs"]] == list(range(1, J.STEPS + 1))
        worst = max(worst, *U.compare_logs(result["logs"][RESUMED], ref[RESUMED], ("loss", "grad_norm"), RTOL).values())
        # Same DP size: the resumed run reads exactly the rows of steps 3-5.
        assert result["rows"][: 3 * J.GA] == full[0]["rows"][2 * J.GA : 5 * J.GA]
    record_property("max_rel_diff", worst)


def test_resume_that_changes_the_global_batch_is_refused_on_every_rank(tmp_path_factory, record_property):
    run_dir, _ = J.uninterrupted(2, tmp_path_factory, timeout=LAUNCH_TIMEOUT_S)
    out = _copy_checkpoint(run_dir, tmp_path_factory.mktemp("resume_dp2_refused"))
    outcomes = _resume(("resume_dp2", J.GA), 4, out, sp=2)

    for outcome in outcomes:
        assert outcome.exitcode == 1 and outcome.error, outcome.rank
        message = outcome.error.strip().splitlines()[-1]
        assert message.startswith("ValueError: This checkpoint was trained with a global batch of 4 sequences"), message
        assert "this run has 8" in message and "DP=2" in message
        assert "set gradient_accumulation_steps=1 or per_device_train_batch_size=1" in message
    # Refused before the first step: nothing was written.
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    record_property("outcome", {"ranks_refused": len(outcomes), "error": message[:110]})


def test_resume_that_keeps_the_global_batch_at_dp2_matches(tmp_path_factory, record_property):
    run_dir, full = J.uninterrupted(2, tmp_path_factory, timeout=LAUNCH_TIMEOUT_S)
    out = _copy_checkpoint(run_dir, tmp_path_factory.mktemp("resume_dp2_ga1"))
    # DP=2 x gradient accumulation 1 = the source's DP=1 x gradient accumulation 2.
    resumed = J.results(_resume(("resume_dp2", 1), 4, out, sp=2, ga=1))

    ref = full[0]
    worst = 0.0
    for result in resumed:
        worst = max(
            worst, *U.compare_logs(result["logs"][RESUMED], ref["logs"][RESUMED], ("loss", "grad_norm"), RTOL).values()
        )
        assert all(math.isfinite(h["loss"]) for h in result["logs"])
    # The two DP groups (ranks 0 and 2) read, step by step, the two micro-batches the source read in one step.
    for step in range(3):
        got = sorted(resumed[0]["rows"][step] + resumed[2]["rows"][step])
        want = sorted(ref["rows"][(2 + step) * J.GA] + ref["rows"][(2 + step) * J.GA + 1])
        assert got == want, step
    record_property("max_rel_diff", worst)

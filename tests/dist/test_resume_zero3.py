"""A ZeRO-3 checkpoint saved at SP=2 resumes at SP=4 and SP=1 through `resume_from_checkpoint=` alone.

ZeRO-3 partitions parameters and optimizer state over every rank, so DeepSpeed loads its checkpoint only at
the world size that saved it (its own errors: a bare `assert len(self.ckpt_list) > 0` at world 4, "used a DP
world size of 2 but the current world size is 1" at world 1). hf_longctx converts it with DeepSpeed's
`ds_to_universal` on rank 0 and loads it universally: steps 3-5 must equal the uninterrupted SP=2 run's.
A checkpoint the converter cannot read is refused on every rank with the command to run by hand. The universal
format carries Adam's moments only: an SGD checkpoint (no state; momentum buffers) is refused on every rank before
the conversion and before DeepSpeed starts, naming the optimizer and what works; on the processes that saved it, it
resumes natively (SGD with momentum: steps 3-5 equal).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests import _faults
from tests.dist import _fault_jobs as J
from tests.dist import _resume_zero3_job as R
from tests.dist import _trainer_utils as U

pytest.importorskip("deepspeed", reason="deepspeed is a dev dependency (pip install -e '.[dev]')")

RTOL = 1e-5
LAUNCH_TIMEOUT_S = 300
PG_TIMEOUT_S = 120.0  # rank 0 converts while the others wait in a collective bounded by it
RESUMED = slice(2, None)  # steps 3-5


def _copy_checkpoint(run_dir: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(Path(run_dir) / "checkpoint-2", dest / "checkpoint-2")
    return dest


def _resume(world: int, out: Path, sp: int, **optim: str | None) -> list[_faults.RankOutcome]:
    return _faults.launch(
        R.resume_job,
        world,
        str(out),
        timeout=LAUNCH_TIMEOUT_S,
        pg_timeout_s=PG_TIMEOUT_S,
        sp=sp,
        checkpoint="checkpoint-2",
        **optim,
    )


# TrainingArguments.optim_args of the SGD runs; plain SGD keeps no state, so its checkpoint-2 is all it needs.
SGD_RUNS = {"sgd": (None, 2), "sgd_momentum": ("momentum=0.9", J.STEPS)}


def _sgd_run(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """An uninterrupted SP=2 ZeRO-3 run with SGD (once per session): its output dir and every rank's result."""
    optim_args, steps = SGD_RUNS[name]
    out = str(tmp_path_factory.getbasetemp() / f"zero3_{name}")
    outcomes = J.launch_once(("zero3", name), 2, out, sp=2, zero3="native", optim="sgd", optim_args=optim_args,
                             steps=steps, timeout=LAUNCH_TIMEOUT_S)  # fmt: skip
    return out, J.results(outcomes)


@pytest.mark.parametrize("sp", [4, 1], ids=["sp4_world4", "sp1_world1"])
def test_zero3_checkpoint_from_sp2_resumes_without_a_conversion_step(sp, tmp_path_factory, record_property):
    run_dir, full = J.uninterrupted(2, tmp_path_factory, timeout=LAUNCH_TIMEOUT_S, zero3="native")
    out = _copy_checkpoint(run_dir, tmp_path_factory.mktemp(f"zero3_resume_sp{sp}"))
    resumed = J.results(_resume(sp, out, sp))

    ref = full[0]["logs"]
    worst = 0.0
    for result in resumed:
        assert [h["step"] for h in result["logs"]] == list(range(1, J.STEPS + 1))
        worst = max(worst, *U.compare_logs(result["logs"][RESUMED], ref[RESUMED], ("loss", "grad_norm"), RTOL).values())
        assert result["rows"][: 3 * J.GA] == full[0]["rows"][2 * J.GA : 5 * J.GA]
    # Converted once, beside the checkpoint, where DeepSpeed's universal load looks for it.
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "latest_universal").read_text().strip() == "global_step2_universal"
    assert (checkpoint / "global_step2_universal" / "zero").is_dir()
    record_property("max_rel_diff", worst)


def test_zero3_checkpoint_that_cannot_be_converted_is_refused_on_every_rank(tmp_path_factory):
    run_dir, _ = J.uninterrupted(2, tmp_path_factory, timeout=LAUNCH_TIMEOUT_S, zero3="native")
    out = _copy_checkpoint(run_dir, tmp_path_factory.mktemp("zero3_resume_broken"))
    folder = out / "checkpoint-2" / "global_step2"
    # Rank 1's optimizer partition lost: the checkpoint now reads as saved by one rank, and cannot be converted.
    (rank1,) = folder.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.remove(rank1)
    outcomes = _resume(2, out, 2)

    command = (
        f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {folder} --output_folder {folder}_universal"
    )
    for outcome in outcomes:
        assert outcome.exitcode == 1 and outcome.error, (outcome.rank, outcome.exitcode, outcome.error)
        message = outcome.error.strip().splitlines()[-1]
        assert message.startswith("RuntimeError: Converting the ZeRO checkpoint"), message
        assert "saved by 1 DP ranks, resumed by 2" in message
        assert message.endswith(f"Convert it by hand, then resume again: {command}"), message
    assert not (out / "checkpoint-2" / "latest_universal").exists()


@pytest.mark.parametrize("name", sorted(SGD_RUNS))
@pytest.mark.parametrize("sp", [4, 1], ids=["sp4_world4", "sp1_world1"])
def test_zero3_sgd_checkpoint_at_another_world_size_is_refused_before_deepspeed(sp, name, tmp_path_factory):
    run, _ = _sgd_run(name, tmp_path_factory)
    outcomes = _faults.launch(R.refusal_job, sp, run, sp=sp, optim_args=SGD_RUNS[name][0], timeout=LAUNCH_TIMEOUT_S)
    state = {"sgd": "saved no per-parameter state", "sgd_momentum": "saved per-parameter state ['momentum_buffer']"}
    for message, wrapper in J.results(outcomes):
        assert message is not None, f"{name} at SP={sp}: resumed instead of refusing"
        assert message.startswith(f"Cannot resume the ZeRO checkpoint {run}/checkpoint-2/global_step2 "), message
        assert f"(saved by 2 DP ranks, resumed by {sp})" in message, message
        assert f"TrainingArguments.optim='sgd' in this run) {state[name]}" in message, message
        assert "ds_to_universal fails on it with a KeyError" in message, message
        assert "Resume on the 2 processes that saved it" in message and "optim='adamw_torch'" in message, message
        assert wrapper == "LlamaForCausalLM", wrapper  # no DeepSpeed engine wraps the model: refused before it
    checkpoint = Path(run) / "checkpoint-2"  # and refused before the conversion
    assert not (checkpoint / "latest_universal").exists() and not list(checkpoint.glob("*_universal"))


def test_zero3_sgd_momentum_checkpoint_resumes_on_the_processes_that_saved_it(tmp_path_factory, record_property):
    run_dir, full = _sgd_run("sgd_momentum", tmp_path_factory)
    out = _copy_checkpoint(run_dir, tmp_path_factory.mktemp("zero3_resume_sgd_momentum"))
    resumed = J.results(_resume(2, out, 2, optim="sgd", optim_args=SGD_RUNS["sgd_momentum"][0]))

    ref = full[0]["logs"]
    worst = 0.0
    for result in resumed:
        assert [h["step"] for h in result["logs"]] == list(range(1, J.STEPS + 1))
        worst = max(worst, *U.compare_logs(result["logs"][RESUMED], ref[RESUMED], ("loss", "grad_norm"), RTOL).values())
    record_property("max_rel_diff", worst)

"""Trainer jobs for the fault and resume tests, run through `tests._faults.launch`.

`train_job` trains the tiny llama with the stock Trainer (AdamW and linear decay: optimizer and scheduler
state to restore; DDP, or DeepSpeed ZeRO-3 on CPU) and can inject one fault on one rank at a chosen step:

- "forward": SIGKILL when the last decoder layer starts (the first layers' all-to-alls have run);
- "backward": SIGKILL when the backward of the first layer's attention starts;
- "optimizer": SIGKILL right before the optimizer step (gradients already all-reduced);
- "freeze": SIGSTOP where "forward" kills: the rank hangs instead of dying.

Before the signal it writes the time to `<out_dir>/fault-rank<r>`. It returns the per-step logs and the
rows the rank collated (in order; the loader reads one batch ahead), so that a restart can be compared
with the uninterrupted run step by step and row by row. `launch_once` runs each distinct launch once
per session.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from transformers import TrainerCallback

import hf_longctx
from tests import _faults
from tests.dist import _trainer_utils as U

PHASES = ("forward", "backward", "optimizer")
STEPS, SAVE_STEPS, GA = 5, 2, 2
ROWS = 48  # one epoch covers every step at DP=2


class FaultInjector(TrainerCallback):
    """Sends the fault's signal to this process when training reaches `step` and `phase`."""

    def __init__(self, model: Any, fault: dict[str, Any], marker: str) -> None:
        self.fault, self.marker, self.step = fault, marker, 0
        layers = model.model.layers
        if fault["phase"] in ("forward", "freeze"):
            layers[-1].register_forward_pre_hook(self._hit)
        elif fault["phase"] == "backward":
            layers[0].self_attn.register_full_backward_pre_hook(self._hit)

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.fault["phase"] == "optimizer":
            self._hit()

    def _hit(self, *args: Any) -> None:
        if self.step != self.fault["step"]:
            return
        with open(self.marker, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP if self.fault["phase"] == "freeze" else signal.SIGKILL)


def _zero3_args(universal: bool) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 on CPU (see test_deepspeed.py): a gloo state must exist before TrainingArguments."""
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    config = {
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
    }
    if universal:
        # Resume from a universal checkpoint (`ds_to_universal`): any DP size can load it.
        config["checkpoint"] = {"load_universal": True}
    return {"deepspeed": config, "accelerator_config": {"use_configured_state": True}, "use_cpu": False}


def train_job(
    rank: int,
    world_size: int,
    out_dir: str,
    *,
    sp: int,
    steps: int = STEPS,
    save_steps: int = SAVE_STEPS,
    ga: int = GA,
    per_device: int = U.BATCH,
    fault: dict[str, Any] | None = None,
    resume: bool = False,
    zero3: str | None = None,
    ddp_timeout: int | None = None,
    optim: str = "adamw_torch",
    optim_args: str | None = None,
) -> dict[str, Any]:
    """Train (or, with `resume`, continue from the last checkpoint in `out_dir`); return logs and rows.

    `optim` / `optim_args` are TrainingArguments' (e.g. "sgd" with "momentum=0.9").
    """
    from transformers import Trainer, TrainingArguments

    from tests._models import tiny_model

    os.makedirs(out_dir, exist_ok=True)
    model = tiny_model("llama")
    collator = U.RecordingCollator()
    extra = _zero3_args(zero3 == "universal") if zero3 else {"use_cpu": True}
    if ddp_timeout is not None:
        extra["ddp_timeout"] = ddp_timeout
    args = TrainingArguments(
        output_dir=out_dir,
        report_to=[],
        disable_tqdm=True,
        seed=1,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ga,
        max_steps=steps,
        optim=optim,
        optim_args=optim_args,
        learning_rate=U.LR[optim],
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=save_steps,
        remove_unused_columns=False,
        parallelism_config=U.parallelism_config(sp),
        **extra,
    )
    callbacks: list[Any] = []
    if zero3 == "universal" and sp == 1:
        # Under SP hf_longctx adds it; without SP the job adds it, as the README says.
        callbacks.append(hf_longctx.integrations.trainer.UniversalCheckpointFix())
    if fault is not None and fault["rank"] == rank:
        callbacks.append(FaultInjector(model, fault, os.path.join(out_dir, f"fault-rank{rank}")))
    trainer = Trainer(
        model=model, args=args, train_dataset=U.dataset("mixed", ROWS), data_collator=collator, callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return {"logs": U.logged_steps(trainer, ("loss", "grad_norm")), **collator.take()}


_launches: dict[Any, Any] = {}


def launch_once(key: Any, world_size: int, out_dir: str, *, timeout: float, **kwargs: Any) -> list[_faults.RankOutcome]:
    """`_faults.launch(train_job, ...)` at most once per session per key (a failure is re-raised each time)."""
    if key not in _launches:
        fault = kwargs.get("fault") or {}
        faulty = [fault["rank"]] if fault.get("phase") == "freeze" else []
        try:
            _launches[key] = _faults.launch(train_job, world_size, out_dir, timeout=timeout, faulty=faulty, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised for every dependent test
            _launches[key] = exc
    result = _launches[key]
    if isinstance(result, Exception):
        raise result
    return result


def uninterrupted(world_size: int, root: Any, *, timeout: float, zero3: str | None = None) -> tuple[str, list[dict]]:
    """The uninterrupted SP=2 run at `world_size` (once per session): its output dir and every rank's result.

    `root` is pytest's `tmp_path_factory`; the fault and resume tests share these runs.
    """
    key = ("run", world_size, zero3)
    if key not in _launches:
        _launches[("dir", key)] = str(root.mktemp(f"run{world_size}{zero3 or ''}"))
    out_dir = _launches[("dir", key)]
    return out_dir, results(launch_once(key, world_size, out_dir, sp=2, zero3=zero3, timeout=timeout))


def results(outcomes: list[_faults.RankOutcome]) -> list[dict[str, Any]]:
    """Every rank's return value; fails with the ranks' errors if any rank did not finish cleanly."""
    bad = [o for o in outcomes if not o.ok or o.result is None]
    assert not bad, "\n\n".join(f"rank {o.rank} exit {o.exitcode} hung={o.hung}:\n{o.error}" for o in bad)
    return [o.result for o in outcomes]


def to_universal(checkpoint: str) -> str:
    """Convert the DeepSpeed checkpoint inside a Trainer checkpoint folder to DeepSpeed's universal format.

    In-process equivalent of `python -m deepspeed.checkpoint.ds_to_universal --input_folder <ckpt>/global_stepN
    --output_folder <ckpt>/global_stepN_universal` (the README's command), which also writes
    `<ckpt>/latest_universal`, the tag DeepSpeed loads when its config has `checkpoint.load_universal`.
    """
    import glob
    from unittest import mock

    from deepspeed.checkpoint import ds_to_universal

    (source,) = glob.glob(os.path.join(checkpoint, "global_step*"))
    target = f"{source}_universal"
    argv = ["ds_to_universal", "--input_folder", source, "--output_folder", target]
    argv += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    with mock.patch("sys.argv", argv):
        ds_to_universal.main(ds_to_universal.parse_arguments())
    return target

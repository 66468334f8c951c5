"""Spawned TRL `DistillationTrainer` jobs for `test_distill.py`: the loss and every gradient of `compute_loss` on
fixed rows per divergence setting, and real `train()` runs, each returning what the test compares with the run
without SP.

The student is the tiny Llama; the teacher a tiny Gemma-2 of another width (96) and weights, with its logit
soft-capping (TRL's kernel and hf_longctx's tiles apply it): only the vocabulary is shared.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch

import hf_longctx
from hf_longctx.integrations.trl import distillation_loss
from hf_longctx.integrations.trl.distillation import distillation_config
from tests._models import tiny_model
from tests.dist._sft_utils import tiny_tokenizer
from tests.dist._trl_jobs import _zero3_args, lora_config

# (beta, temperature): forward KL, the generalised JSD, reverse KL, each at 1 and another temperature.
SETTINGS = ((0.0, 1.0), (0.0, 2.0), (0.5, 1.0), (0.3, 0.7), (1.0, 1.0), (1.0, 1.5))
# The loss job on LoRA adapters (the student through `peft_config`), under ring attention (zigzag shards) at SP > 1,
# with a Llama teacher (ring refuses Gemma-2's attention soft-capping).
LORA_RING = {"peft": True, "teacher": "llama", "sp_options": {"sp_backend": "ring"}}
LORA_RING_SETTINGS = ((0.5, 1.0), (1.0, 1.5))
# Trainer runs: DistillationConfig overrides, plus "sp_options" (the SP side's ParallelismConfig fields), "zero"
# (DeepSpeed stage, both sides) and "evaluate" (trainer.evaluate() at the end).
RUNS: dict[str, dict[str, Any]] = {
    # The JSD at temperature 2 (sampling too), accumulation 2, gradient checkpointing, hf_longctx's tiles for the
    # divergence, TRL's completion log; then evaluation (generation and the whole-row loss).
    "jsd_tiled": {
        "beta": 0.5,
        "temperature": 2.0,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": True,
        "log_completions": True,
        "evaluate": True,
        "sp_options": {"tiled_loss": True},
    },
}
# DP=2 x SP=2 against DP=2: the reverse KL (TRL's default beta) through TRL's kernel on the shards, student and
# teacher under DeepSpeed ZeRO-3, accumulation 2. Last in its spawn: it leaves accelerate's state set for DeepSpeed.
DP_RUNS: dict[str, dict[str, Any]] = {
    "dp2_zero3": {"beta": 1.0, "gradient_accumulation_steps": 2, "zero": 3},
}
# Token ids that end a completion (besides the tokenizer's eos): the random student stops at one now and then, so
# completions differ in length.
EOS_IDS = list(range(2, 20))
STEPS = 3
LOGIT_SCALE = 20.0
_NOT_COMPARED = ("time", "runtime", "per_second", "flos")  # wall-clock keys


def prompts(n: int = 8, seed: int = 7):
    """Prompts of 1 to 8 words: with 6-token completions, some rows are scored on one SP rank only and some across
    the shard boundary."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 128, (1 + (3 * i) % 8,), generator=g).tolist()
        rows.append({"prompt": " ".join(f"t{t}" for t in ids)})
    return Dataset.from_list(rows)


def _peaked(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with its LM head scaled up: logits of std ~3 instead of ~0.15, so the next-token distributions are
    peaked as a trained model's (at random init they are near uniform, and every divergence is a small difference of
    O(log vocab) float32 terms, whose rounding the run without SP has too)."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE)
    return model


def teacher_model(arch: str = "gemma2") -> torch.nn.Module:
    """A tiny Gemma-2 (final logit soft-capping 30; or another `arch`), wider than the student, other weights, the
    same vocabulary."""
    return _peaked(tiny_model(arch, hidden=96, attn="eager" if arch == "gemma2" else "sdpa", seed=5))


def _recording(base: type) -> type:
    """A subclass recording the prompt and completion ids of every generation (below the SP patch)."""

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any):
        completion_ids = base._generate_single_turn(self, prompt_ids, *args, **kwargs)
        self.generations.append((list(prompt_ids), list(completion_ids)))
        return completion_ids

    return type(f"Recording{base.__name__}", (base,), {"_generate_single_turn": _generate_single_turn})


@contextlib.contextmanager
def recorded_shards() -> Iterator[list[list[int]]]:
    """Inside the block, per `shard_rows` call on this rank: the number of scored positions of each row in its
    shard (the SP path's sharding, wrapped in this process only)."""
    counts: list[list[int]] = []
    shard_rows = distillation_loss.shard_rows

    def recording(*args: Any, **kwargs: Any) -> dict[str, Any]:
        shard = shard_rows(*args, **kwargs)
        counts.append((shard["shift_labels"] != -100).sum(1).tolist())
        return shard

    distillation_loss.shard_rows = recording
    try:
        yield counts
    finally:
        distillation_loss.shard_rows = shard_rows


def _skewed(base: type) -> type:
    """A subclass whose SP rank 1 samples from another RNG stream than its peer (below the SP patch, which has just
    given both the same one)."""

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        if torch.distributed.get_rank() == 1:
            torch.manual_seed(1234)
        return base._generate_single_turn(self, *args, **kwargs)

    return type(f"Skewed{base.__name__}", (base,), {"_generate_single_turn": _generate_single_turn})


def build(
    out_dir: str,
    sp: int,
    sp_options: dict | None = None,
    zero: int | None = None,
    skew: bool = False,
    peft: bool = False,
    teacher: str = "gemma2",
    **extra: Any,
):
    """A `DistillationTrainer` (recording generations; `skew`: see `_skewed`; `peft`: LoRA adapters on the student
    through `peft_config`) at `sp` (1: without SP; TRL's own code)."""
    from trl import DistillationTrainer

    evaluate = extra.pop("evaluate", False)
    parallelism = hf_longctx.ParallelismConfig(sp_size=sp, **(sp_options or {})) if sp > 1 else None
    fields = dict(
        output_dir=out_dir, report_to=[], disable_tqdm=True, seed=1, bf16=False, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, max_completion_length=6, max_steps=STEPS, optim="sgd", learning_rate=0.1,
        max_grad_norm=1e9, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        gradient_checkpointing=False, parallelism_config=parallelism, **_zero3_args(zero),
    )  # fmt: skip
    args = distillation_config(**{**fields, **extra})
    student = _peaked(tiny_model("llama"))
    student.generation_config.eos_token_id = EOS_IDS
    cls = _recording(DistillationTrainer)
    trainer = (_skewed(cls) if skew else cls)(
        model=student,
        teacher_model=teacher_model(teacher),
        peft_config=lora_config() if peft else None,
        args=args,
        train_dataset=prompts(),
        eval_dataset=prompts(4, seed=11) if evaluate else None,
        processing_class=tiny_tokenizer(),
    )
    trainer.generations = []
    return trainer


def _restored(trainer: Any) -> bool:
    """After `detach`: no instance patch left on the trainer, TRL's module-level gather_object is accelerate's."""
    from accelerate.utils import operations
    from trl.trainer import distillation_trainer

    left = {"_generate_single_turn", "_prepare_inputs", "compute_loss", "get_train_dataloader"} & set(vars(trainer))
    return not left and distillation_trainer.gather_object is operations.gather_object


def train(out_dir: str, sp: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One `train()` (and `evaluate()`): every logged step and eval metric, every generation, the shards' rows."""
    from hf_longctx.integrations.trainer import detach

    spec = dict(spec)
    evaluate = spec.get("evaluate", False)
    if sp == 1:
        spec.pop("sp_options", None)
    with recorded_shards() as counts:
        trainer = build(out_dir, sp, **spec)
        trainer.train()
        metrics = trainer.evaluate() if evaluate else {}
    student = trainer.accelerator.unwrap_model(trainer.model)
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model)
    attn = (student.config._attn_implementation, teacher.config._attn_implementation)
    detach(trainer)
    steps = [
        {k: v for k, v in entry.items() if not any(word in k for word in _NOT_COMPARED)}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    evaluated = {k: v for k, v in metrics.items() if not any(word in k for word in _NOT_COMPARED)}
    tables = {key: list(log) for key, log in trainer._logs.items()}
    return {"steps": steps, "eval": evaluated, "generations": trainer.generations, "shards": counts, "tables": tables,
            "attn": attn, "restored": _restored(trainer)}  # fmt: skip


PROMPT_LEN, COMPLETION_LEN = 8, 5
# (left padding, completion length) per row; 13 tokens (odd: SP pads). At SP=2 (shards of 7) row 0 is scored on
# rank 1 only, row 1 on rank 0 only, rows 2 and 3 across the boundary; at SP=4 (shards of 4) rows span 1 to 3 ranks.
ROWS = ((0, 5), (6, 2), (3, 5), (1, 3))


def fixed_inputs() -> dict[str, torch.Tensor]:
    """One micro-batch as TRL's `_prepare_inputs` returns it: left-padded prompts, right-padded completions, a
    multi-turn `tool_mask` (a tool result inside row 2's completion is not scored) and the scored-token count."""
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, 128, (len(ROWS), PROMPT_LEN), generator=g)
    completion_ids = torch.randint(3, 128, (len(ROWS), COMPLETION_LEN), generator=g)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    for row, (pad, length) in enumerate(ROWS):
        prompt_mask[row, :pad] = 0
        completion_mask[row, length:] = 0
    tool_mask = torch.ones_like(completion_ids)
    tool_mask[2, 1:3] = 0
    return {
        "prompt_ids": prompt_ids.masked_fill(prompt_mask == 0, 0),
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids.masked_fill(completion_mask == 0, 0),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "num_items_in_batch": (completion_mask * tool_mask).sum(),
    }


def loss_job(rank: int, world_size: int, out_dir: str, settings: tuple = SETTINGS, **options: Any) -> dict[str, Any]:
    """Per `SETTINGS` entry and divergence path (TRL's kernel, hf_longctx's tiles under SP): the loss, the entropy
    metric and every student gradient of one training `compute_loss` + backward on `fixed_inputs()`, and the loss
    of one evaluation `compute_loss`. Both sides: DDP-averaged gradients of the prepared student. `options`: `build`'s
    (`sp_options` on the SP side only)."""
    from hf_longctx.integrations.trainer import detach
    from hf_longctx.integrations.trainer.state import sp_state

    if world_size == 1:
        options.pop("sp_options", None)
    trainer = build(os.path.join(out_dir, "loss" + "_".join(map(str, options))), world_size, **options)
    model = trainer.accelerator.prepare(trainer.model)
    state = sp_state(trainer)
    inputs = fixed_inputs()
    results: dict[str, Any] = {}
    with recorded_shards() as counts:
        for beta, temperature in settings:
            for tiled in (False, True) if state is not None else (False,):
                if state is not None:
                    state.config.tiled_loss = tiled  # read at every step: the divergence path of this case
                trainer.beta, trainer.temperature = beta, temperature
                trainer.model.train()
                model.zero_grad(set_to_none=True)
                loss = trainer.compute_loss(model, dict(inputs))
                trainer.accelerator.backward(loss)
                trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
                grads = {n: p.grad.detach().clone() for n, p in trained}
                trainer.model.eval()
                with torch.no_grad():
                    eval_inputs = {k: v for k, v in inputs.items() if k != "num_items_in_batch"}
                    eval_loss = trainer.compute_loss(model, eval_inputs).item()
                results[(beta, temperature, tiled)] = {
                    "loss": loss.item(),
                    "entropy": trainer._metrics["train"]["entropy"][-1],
                    "eval_loss": eval_loss,
                    "eval_entropy": trainer._metrics["eval"]["entropy"][-1],
                    "grads": grads,
                }
    results["shards"] = counts[:1]
    detach(trainer)
    return results


def generation_job(rank: int, world_size: int, out_dir: str) -> dict[str, str | None]:
    """Under SP: the SP ranks of a group generating different tokens raise on every rank, and options without an
    exact SP path are refused while the trainer is built (None: no error)."""
    from hf_longctx.integrations.trainer import detach

    trainer = build(os.path.join(out_dir, "skew"), world_size, skew=True)
    messages: dict[str, str | None] = {}
    try:
        trainer._generate_single_turn([[5, 6, 7], [8]], None, {})
        messages["diverged"] = None
    except ValueError as exc:
        messages["diverged"] = str(exc)
    detach(trainer)
    for name, options in {"use_vllm": {"use_vllm": True}}.items():
        try:
            build(os.path.join(out_dir, name), world_size, **options)
            messages[name] = None
        except NotImplementedError as exc:
            messages[name] = str(exc)
    return messages


def worker(
    rank: int,
    world_size: int,
    out_dir: str,
    loss: bool,
    run_sp: int,
    names: list[str],
    checks: bool = False,
    whole: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The loss jobs at SP = the world size (with `loss`: plain and `LORA_RING`), the generation checks (with
    `checks`), the runs of `RUNS` named in `whole` at SP = the world size (results under "<name>@sp<world>"), then
    each named run of `RUNS` / `DP_RUNS` at `run_sp` (1: without SP). A run that raises on every rank alike reports
    its error and the next one runs."""
    results: dict[str, Any] = {}
    if loss:
        results["loss"] = loss_job(rank, world_size, out_dir)
        results["loss_lora_ring"] = loss_job(rank, world_size, out_dir, LORA_RING_SETTINGS, **LORA_RING)
    if checks:
        results["generation"] = generation_job(rank, world_size, out_dir)
    specs = {**RUNS, **DP_RUNS}
    runs = [(f"{name}@sp{world_size}", name, world_size) for name in whole] + [(name, name, run_sp) for name in names]
    for key, name, sp in runs:
        try:
            results[key] = train(os.path.join(out_dir, key), sp, specs[name])
        except ValueError:
            results[key] = {"error": traceback.format_exc()}
    return results

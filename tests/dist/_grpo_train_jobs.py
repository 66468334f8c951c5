"""Spawned GRPO `train()` runs for `test_grpo_train.py`: the configurations RL runs use (gradient accumulation,
`num_iterations`, explicit generation sizes, ring, LoRA, batch-wide statistics, DP x SP), each run once per
spawn, returning what the test compares with the run without SP: every per-step log entry, the prompts and
completions of every generation, TRL's completion tables and the generation sizes.

Sampling is TRL's own (not seeded by prompt): the SP run must sample what the run without SP samples.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest

from tests._models import tiny_model
from tests.dist._grpo_jobs import _dataset, _trainer, id_reward, toy_reward

# Each run: config overrides, plus "trainer" ("grpo" by default, or "rloo"), "sp_backend" (the SP side's backend),
# "model": "lora" (the tiny Llama with LoRA adapters; its reference is the adapter disabled), "moe" (a tiny Qwen3-MoE),
# "peft_config" (the tiny Llama with `peft_config=lora_config()`) or "path" (the tiny Llama saved and passed by path,
# so TRL can load a reference model), "rewards": "two" (two reward functions), "reward_model": True (a tiny sequence
# classifier as one more reward), "short_rows": True (see `_recording`), "zero": a DeepSpeed ZeRO stage, "evaluate":
# True (`trainer.evaluate()` after training).
RUNS: dict[str, dict[str, Any]] = {
    # steps_per_generation = 2 by default: one generation per optimizer step, split over 2 micro-steps.
    "accumulation": {"gradient_accumulation_steps": 2, "max_steps": 2},
    # Each generation trains two optimizer steps (the second off-policy: clipping).
    "iterations": {"num_iterations": 2, "max_steps": 3},
    "steps_per_generation": {"steps_per_generation": 2, "max_steps": 3},
    "generation_batch_size": {"generation_batch_size": 4, "max_steps": 2},
    # Batch-wide statistics over the gathered batch: the std of all rewards, the entropy quantile.
    "batch_statistics": {"scale_rewards": "batch", "top_entropy_quantile": 0.5, "rewards": "two", "max_steps": 2},
    "ring": {"sp_backend": "ring", "num_iterations": 2, "max_steps": 2},
    "lora": {"model": "lora", "beta": 0.1, "max_steps": 2},
    # A Qwen3-MoE with its router loss on (coefficient 0.3): TRL adds the chunks' mean router loss to the loss.
    "moe": {"model": "moe", "max_steps": 2},
}
# DP=2: one prompt's 2 generations are split over the 2 DP ranks (per_device_train_batch_size=1), and the rewards
# of two functions are normalised over the batch before they are summed.
DP_RUNS: dict[str, dict[str, Any]] = {
    "dp2": {
        "per_device_train_batch_size": 1,
        "multi_objective_aggregation": "normalize_then_sum",
        "rewards": "two",
        "max_steps": 2,
    },
}
_NOT_COMPARED = ("time", "runtime", "per_second", "flos")  # wall-clock keys
RTOL = 1e-5
# The on-policy loss is a mean of advantages that sum to 0 per group: float noise around 0, compared absolutely below
# this magnitude (relative above).
LOSS_FLOOR = 1e-2
FLOORS = {"loss": LOSS_FLOOR, "eval_loss": LOSS_FLOOR}


def _recording(base: type, short_rows: bool = False) -> type:
    """A subclass recording the prompt and completion ids of every generation (below the SP patch); `short_rows`:
    the first completion of each generation becomes the end-of-sequence token alone, so that row's prompt +
    completion fits in SP rank 0's shard of the padded batch and the other ranks hold only its padding."""

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any):
        result = base._generate_single_turn(self, prompt_ids, *args, **kwargs)
        # GRPO returns (completion_ids, logprobs), RLOO the completion ids alone.
        completion_ids = list(result[0] if isinstance(result, tuple) else result)
        if short_rows:
            completion_ids[0] = [self.eos_token_ids[0]]
            if isinstance(result, tuple):
                logprobs = result[1] if result[1] is None else [result[1][0][:1], *result[1][1:]]
                result = (completion_ids, logprobs, *result[2:])
            else:
                result = completion_ids
        self.generations.append((list(prompt_ids), completion_ids))
        return result

    return type(
        f"Recording{base.__name__}", (base,), {"_generate_single_turn": _generate_single_turn, "generations": None}
    )


# The trainers a run's "trainer" key names: (TRL class, its hf_longctx config builder, the module of its gathers).
TRAINERS = {
    "grpo": ("GRPOTrainer", "hf_longctx.integrations.trl.grpo:grpo_config", "trl.trainer.grpo_trainer"),
    "rloo": ("RLOOTrainer", "hf_longctx.integrations.trl.rloo:rloo_config", "trl.trainer.rloo_trainer"),
}


def _train(out_dir: str, sp: int, spec: dict[str, Any]) -> dict[str, Any]:
    import importlib

    import torch
    import trl
    from accelerate.utils import operations

    from hf_longctx.integrations.trainer import detach
    from tests.dist._sft_utils import tiny_tokenizer
    from tests.dist._trl_jobs import _zero3_args, reward_model

    spec = dict(spec)
    name, builder, module = TRAINERS[spec.pop("trainer", "grpo")]
    module = importlib.import_module(module)
    builder_module, builder_name = builder.split(":")
    builder = getattr(importlib.import_module(builder_module), builder_name)
    backend = spec.pop("sp_backend", None)
    model = spec.pop("model", None)
    if model == "lora":
        from tests.dist._trl_jobs import lora_model

        model = lora_model()
    elif model == "moe":
        from tests._sequence_models import sequence_model

        model = sequence_model("moe:qwen3_moe")
    elif model == "path":
        # Saved and passed by path: TRL loads a reference model (beta > 0) from the policy's path.
        model = os.path.join(out_dir, "policy")
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            tiny_model("llama").save_pretrained(model)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
    rewards = [toy_reward, id_reward] if spec.pop("rewards", None) == "two" else [id_reward]
    trainer_kwargs = {}
    if model == "peft_config":  # TRL wraps the tiny Llama in fresh adapters: the reference is the adapter disabled
        from tests.dist._trl_jobs import lora_config

        model, trainer_kwargs["peft_config"] = None, lora_config()
    if spec.pop("reward_model", False):  # a tiny sequence classifier scores the texts too
        rewards.append(reward_model())
        trainer_kwargs["reward_processing_classes"] = [None] * (len(rewards) - 1) + [tiny_tokenizer()]
    evaluate = spec.pop("evaluate", False)  # then trainer.evaluate() on 4 other prompts
    zero = spec.pop("zero", None)
    if zero is not None:
        spec.update(_zero3_args(zero))
    trainer = _trainer(
        out_dir,
        sp,
        model=model,
        reward=rewards if len(rewards) > 1 else rewards[0],
        sp_options={"sp_backend": backend} if backend else None,
        base=_recording(getattr(trl, name), short_rows=spec.pop("short_rows", False)),
        builder=builder,
        trainer_kwargs=trainer_kwargs,
        **spec,
    )
    trainer.generations = []
    trainer.train()
    metrics = trainer.evaluate(_dataset(4)) if evaluate else None
    attention = trainer.model.config._attn_implementation
    detach(trainer)
    # Everything SP changed is undone: the trainer's own methods and TRL's module-level gathers.
    patched = {"training_step", "prediction_step", "_generate_single_turn", "_calculate_rewards"}
    left = patched & set(vars(trainer))
    gathers = (module.gather, module.gather_object)
    restored = not left and gathers == (operations.gather, operations.gather_object)
    steps = [{k: v for k, v in entry.items() if not _skip(k)} for entry in trainer.state.log_history if "loss" in entry]
    tables = {key: list(trainer._logs[key]) for key in ("prompt", "completion", "advantages")}
    tables.update({f"rewards/{k}": list(v) for k, v in trainer._logs["rewards"].items()})
    return {
        "steps": steps,
        "eval": None if metrics is None else {k: v for k, v in metrics.items() if not _skip(k)},
        "generations": trainer.generations,
        "tables": tables,
        "sizes": (trainer.args.generation_batch_size, trainer.args.steps_per_generation),
        "attn": attention,
        "restored": restored,
    }


def _skip(key: str) -> bool:
    return any(word in key for word in _NOT_COMPARED)


def runs_job(
    rank: int, world_size: int, out_dir: str, sp: int, names: list[str], specs: dict[str, dict] | None = None
) -> dict[str, Any]:
    """Each named run of `specs` (default: `RUNS` / `DP_RUNS`) in turn, at `sp` (1: without SP). A run that raises
    on every rank alike (a refused option) reports its error and the next one runs."""
    specs, results = specs or {**RUNS, **DP_RUNS}, {}
    for name in names:
        try:
            results[name] = _train(os.path.join(out_dir, name), sp, specs[name])
        except ValueError:
            results[name] = {"error": traceback.format_exc()}
    return results


def assert_same_run(got: dict, want: dict, floors: dict[str, float] = FLOORS) -> dict[str, float]:
    """The same prompts and completions at every generation, every step's metrics within RTOL (relative, or absolute
    below `floors[key]`), the same completion tables and generation sizes; returns the worst rel diff per metric."""
    assert "error" not in want, want["error"]
    assert "error" not in got, got["error"]
    assert len(got["generations"]) == len(want["generations"]) > 0
    for index, (mine, ref) in enumerate(zip(got["generations"], want["generations"], strict=True)):
        assert mine[0] == ref[0], f"generation {index} is for other prompts"
        assert mine[1] == ref[1], f"generation {index} sampled other completions"
    worst: dict[str, float] = {}
    assert len(got["steps"]) == len(want["steps"]) > 0
    # trainer.evaluate()'s metrics, as a last step (-1).
    evaluation = [] if want.get("eval") is None else [({**got["eval"], "step": -1}, {**want["eval"], "step": -1})]
    for mine, ref in [*zip(got["steps"], want["steps"], strict=True), *evaluation]:
        assert mine.keys() == ref.keys(), (sorted(mine), sorted(ref))
        for key, value in ref.items():
            if value is None:  # TRL logs None for a metric without a valid value (every reward None)
                assert mine[key] is None, (ref["step"], key, mine[key])
                continue
            floor = floors.get(key, 1e-30)
            diff = abs(mine[key] - value) / max(abs(value), floor)
            assert diff <= RTOL, (ref["step"], key, mine[key], value)
            worst[key] = max(worst.get(key, 0.0), diff)
    assert got["tables"].keys() == want["tables"].keys()
    for key, ref in want["tables"].items():
        if key == "advantages" or key.startswith("rewards/"):
            assert got["tables"][key] == pytest.approx(ref, rel=RTOL, abs=1e-6), key
        else:
            assert got["tables"][key] == ref, key
    assert got["sizes"] == want["sizes"]
    return worst

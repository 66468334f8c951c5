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

from tests.dist._grpo_jobs import _trainer, id_reward, toy_reward

# Each run: GRPOConfig overrides, plus "sp_backend" (the SP side's backend), "model": "lora" (the tiny Llama with
# LoRA adapters; its reference is the adapter disabled) or "moe" (a tiny Qwen3-MoE), "rewards": "two" (two reward
# functions).
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


def _recording(base: type) -> type:
    """A subclass recording the prompt and completion ids of every generation (below the SP patch)."""

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any):
        completion_ids, logprobs = base._generate_single_turn(self, prompt_ids, *args, **kwargs)
        self.generations.append((list(prompt_ids), list(completion_ids)))
        return completion_ids, logprobs

    return type(
        f"Recording{base.__name__}", (base,), {"_generate_single_turn": _generate_single_turn, "generations": None}
    )


def _train(out_dir: str, sp: int, spec: dict[str, Any]) -> dict[str, Any]:
    from accelerate.utils import operations
    from trl import GRPOTrainer
    from trl.trainer import grpo_trainer

    from hf_longctx.integrations.trainer import detach

    spec = dict(spec)
    backend = spec.pop("sp_backend", None)
    model = spec.pop("model", None)
    if model == "lora":
        from tests.dist._trl_jobs import lora_model

        model = lora_model()
    elif model == "moe":
        from tests._sequence_models import sequence_model

        model = sequence_model("moe:qwen3_moe")
    rewards = [toy_reward, id_reward] if spec.pop("rewards", None) == "two" else id_reward
    trainer = _trainer(
        out_dir,
        sp,
        model=model,
        reward=rewards,
        sp_options={"sp_backend": backend} if backend else None,
        base=_recording(GRPOTrainer),
        **spec,
    )
    trainer.generations = []
    trainer.train()
    attention = trainer.model.config._attn_implementation
    detach(trainer)
    # Everything SP changed is undone: the trainer's own methods and TRL's module-level gathers.
    left = {"training_step", "prediction_step", "_generate_single_turn"} & set(vars(trainer))
    gathers = (grpo_trainer.gather, grpo_trainer.gather_object)
    restored = not left and gathers == (operations.gather, operations.gather_object)
    steps = [
        {k: v for k, v in entry.items() if not any(word in k for word in _NOT_COMPARED)}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    tables = {key: list(trainer._logs[key]) for key in ("prompt", "completion", "advantages")}
    tables.update({f"rewards/{k}": list(v) for k, v in trainer._logs["rewards"].items()})
    return {
        "steps": steps,
        "generations": trainer.generations,
        "tables": tables,
        "sizes": (trainer.args.generation_batch_size, trainer.args.steps_per_generation),
        "attn": attention,
        "restored": restored,
    }


def runs_job(rank: int, world_size: int, out_dir: str, sp: int, names: list[str]) -> dict[str, Any]:
    """Each named run of `RUNS` / `DP_RUNS` in turn, at `sp` (1: without SP). A run that raises on every rank
    alike (a refused option) reports its error and the next one runs."""
    specs, results = {**RUNS, **DP_RUNS}, {}
    for name in names:
        try:
            results[name] = _train(os.path.join(out_dir, name), sp, specs[name])
        except ValueError:
            results[name] = {"error": traceback.format_exc()}
    return results

"""Spawned RLOO jobs for `test_rloo.py`: one loss + backward per clipping variant on fixed completions, and real
`RLOOTrainer.train()` runs (the GRPO train jobs, `_grpo_train_jobs.runs_job`, with `"trainer": "rloo"`).

Each spawn runs everything its side of a comparison needs (spawning and importing TRL costs more than the runs).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from tests.dist import _grpo_train_jobs as T
from tests.dist._grpo_jobs import _trainer

# Clipping of RLOO's per-sequence ratio (TRL 1.16 has no other loss variant): symmetric, and asymmetric
# (`epsilon_high`); the MoE router loss is the `moe` model's.
VARIANTS = {"clip": (0.2, 0.2), "asymmetric": (0.1, 0.4)}
PROMPT_LEN, COMPLETION_LEN = 5, 6
# Per row: (left padding of the prompt, completion tokens). 11 tokens: SP=2 and SP=4 pad to 12. Rotated to start at
# the first real token: row 0's completion straddles every shard boundary; rows 1 and 3 (2 tokens) lie in rank 0's
# shard while the other ranks hold only their padding; row 3's completion is fully masked (a masked truncated row).
ROWS = ((0, 6), (4, 1), (1, 3), (3, 0), (2, 5))
ADVANTAGES = (1.0, -0.5, 0.7, -1.2, 0.4)
# Old summed log-probs, relative to the new ones (about -4.85 per token on the random tiny model): ratios around
# exp(+-0.3), so some rows are clipped low and some high.
OLD_OFFSETS = (0.3, -0.25, -0.3, 0.0, 0.15)

# RLOO's kl is a mean of signed first-order log ratios (about 0.1 each here) that can cancel to near 0 (seen: -0.0039
# after evaluate()): compared absolutely below 1e-2, like the on-policy loss.
FLOORS = {**T.FLOORS, "kl": T.LOSS_FLOOR, "eval_kl": T.LOSS_FLOOR}

# Real train() runs, SP=2 against no SP. `combined`: gradient accumulation 2 and 2 iterations per generation
# (the second off-policy: ratios away from 1), a reference model (beta > 0: the summed KL enters the rewards),
# normalised advantages, three weighted rewards (one a sequence classifier) clipped to a range, and short rows.
# `lora`: LoRA adapters from `peft_config`, whose reference is the policy with the adapter disabled, then evaluate().
RUNS: dict[str, dict[str, Any]] = {
    "combined": {
        "trainer": "rloo",
        "model": "path",
        "beta": 0.1,
        "gradient_accumulation_steps": 2,
        "num_iterations": 2,
        "learning_rate": 0.02,  # the second iteration clips some rows, not all (a gradient at every step)
        "normalize_advantages": True,
        "rewards": "two",
        "reward_model": True,
        "reward_weights": [1.0, 0.5, 2.0],
        "reward_clip_range": (-0.5, 1.5),
        "short_rows": True,
        "max_steps": 3,
    },
    "lora": {
        "trainer": "rloo",
        "model": "peft_config",
        "beta": 0.1,
        "short_rows": True,
        "max_steps": 3,
        "evaluate": True,
        "per_device_eval_batch_size": 2,
    },
}
# DP=2 under ZeRO-3 (one prompt's 2 generations split over the DP ranks: per_device_train_batch_size=1), a reference
# model, gradient accumulation 2.
DP_RUNS: dict[str, dict[str, Any]] = {
    "zero3": {
        "trainer": "rloo",
        "zero": 3,
        "model": "path",
        "beta": 0.1,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "short_rows": True,
        "max_steps": 3,
    },
}


def fixed_inputs() -> dict[str, torch.Tensor]:
    """`ROWS` as RLOO's training batch: left-padded prompts, right-padded completions, advantages and old log-probs
    (the summed log-probs of each completion under the policy that generated it)."""
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, 128, (len(ROWS), PROMPT_LEN), generator=g)
    completion_ids = torch.randint(3, 128, (len(ROWS), COMPLETION_LEN), generator=g)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    for row, (pad, n) in enumerate(ROWS):
        prompt_mask[row, :pad] = 0
        completion_mask[row, n:] = 0
    tokens = completion_mask.sum(1).float()
    return {
        "prompt_ids": prompt_ids.masked_fill(prompt_mask == 0, 0),
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids.masked_fill(completion_mask == 0, 0),
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES),
        "old_logps": -4.85 * tokens + torch.tensor(OLD_OFFSETS),
    }


def loss_job(
    rank: int, world_size: int, out_dir: str, model: str = "llama", sp_options: dict | None = None
) -> dict[str, Any]:
    """Loss, grad_norm, every parameter's gradient and the metrics `_compute_loss` logs, per `VARIANTS` entry, at
    sp_size = world_size (1: without SP); inside the data-parallel view the trainer's steps use under SP.

    model: "llama" (the tiny Llama) or "moe" (a tiny Qwen3-MoE, its router loss in the loss); sp_options: more
    `ParallelismConfig` fields (the SP backend)."""
    from trl import RLOOTrainer

    from hf_longctx.integrations.trainer import detach
    from hf_longctx.integrations.trainer.state import sp_state
    from hf_longctx.integrations.trl.grpo_data_parallel import data_parallel_view
    from hf_longctx.integrations.trl.rloo import rloo_config

    policy = None
    if model == "moe":
        from tests._sequence_models import sequence_model

        policy = sequence_model("moe:qwen3_moe")
    trainer = _trainer(
        os.path.join(out_dir, f"loss_{model}"), world_size, model=policy, base=RLOOTrainer, builder=rloo_config,
        sp_options=sp_options, beta=0.0,
    )  # fmt: skip
    wrapped = trainer.accelerator.prepare(trainer.model)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train() at each step
    state = sp_state(trainer)

    def view() -> Any:
        return data_parallel_view(trainer, state.groups) if state is not None else contextlib.nullcontext()

    results: dict[str, Any] = {"attn": trainer.model.config._attn_implementation}
    for name, (low, high) in VARIANTS.items():
        trainer.epsilon_low, trainer.epsilon_high = low, high
        wrapped.zero_grad(set_to_none=True)
        trainer._metrics["train"].clear()
        with view():
            loss = trainer._compute_loss(wrapped, fixed_inputs())
        trainer.accelerator.backward(loss)
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        metrics = {key: values[-1] for key, values in trainer._metrics["train"].items()}
        results[name] = {"loss": loss.item(), "grad_norm": norm.item(), "grads": grads, "metrics": metrics}
    detach(trainer)  # releases TRL's module-level gathers for the runs after this one
    return results


def refusal_job(rank: int, world_size: int, out_dir: str) -> dict[str, str | None]:
    """The message each RLOO setup without an exact SP path raises while the trainer is built (None: built)."""
    from trl import RLOOConfig, RLOOTrainer

    import hf_longctx
    from hf_longctx.integrations.trl.rloo import rloo_config
    from tests._models import tiny_model
    from tests.dist._grpo_jobs import _dataset, _trainer_fields, toy_reward
    from tests.dist._sft_utils import tiny_tokenizer

    def build(args: Any) -> None:
        RLOOTrainer(model=tiny_model("llama"), reward_funcs=toy_reward, args=args, train_dataset=_dataset(),
                    processing_class=tiny_tokenizer())  # fmt: skip

    fields = {**_trainer_fields(out_dir), "beta": 0.0}
    parallelism = hf_longctx.ParallelismConfig(sp_size=world_size)

    def sized_by_every_process() -> None:
        # As a script that parses an RLOOConfig and sets parallelism_config afterwards: TRL counted 2 DP ranks.
        args = RLOOConfig(**fields)
        args.parallelism_config = parallelism
        build(args)

    def continuous_batching() -> None:
        build(rloo_config(**fields, parallelism_config=parallelism, use_transformers_continuous_batching=True))

    messages: dict[str, str | None] = {}
    for name, make in (
        ("sized_by_every_process", sized_by_every_process),
        ("continuous_batching", continuous_batching),
    ):
        try:
            make()
            messages[name] = None
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def reference_job(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """The side without SP (1 process): the loss passes and the train runs."""
    return {
        "loss": loss_job(rank, world_size, out_dir),
        "loss_moe": loss_job(rank, world_size, out_dir, "moe"),
        "runs": T.runs_job(rank, world_size, os.path.join(out_dir, "runs"), 1, list(RUNS), RUNS),
    }


def sp_job(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """The SP=2 side in one spawn: the loss passes, the train runs and the refusals."""
    return {
        "loss": loss_job(rank, world_size, out_dir),
        "loss_moe": loss_job(rank, world_size, out_dir, "moe"),
        # Ring attention: zigzag shards, whose all-gather in rank order is not sequence order.
        "loss_ring": loss_job(rank, world_size, os.path.join(out_dir, "ring"), sp_options={"sp_backend": "ring"}),
        "runs": T.runs_job(rank, world_size, os.path.join(out_dir, "runs"), world_size, list(RUNS), RUNS),
        "refusals": refusal_job(rank, world_size, os.path.join(out_dir, "refused")),
    }


def dp_job(rank: int, world_size: int, out_dir: str, sp: int) -> dict[str, Any]:
    """`DP_RUNS` at `sp` (world 2, sp 1: DP=2; world 4, sp 2: DP=2 x SP=2); at world 4 first the loss passes and
    the `combined` run at SP=4 (DDP), before the ZeRO-3 run resets accelerate's state."""
    result = {}
    if world_size == 4:
        result["loss"] = loss_job(rank, world_size, out_dir)
        result["sp4"] = T.runs_job(rank, world_size, os.path.join(out_dir, "sp4"), 4, ["combined"], RUNS)
    result["runs"] = T.runs_job(rank, world_size, os.path.join(out_dir, "runs"), sp, list(DP_RUNS), DP_RUNS)
    return result

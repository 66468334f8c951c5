"""Spawned GRPO jobs for `test_grpo.py`: one loss/gradient pass per `loss_type` on fixed completions, and a
real `GRPOTrainer.train()` generating with transformers on CPU."""

from __future__ import annotations

import os
import zlib
from typing import Any

import torch

import hf_longctx
from hf_longctx.integrations.trl.grpo import grpo_config
from tests._models import tiny_model
from tests.dist._sft_utils import tiny_tokenizer

# (loss_type, importance_sampling_level): luspo needs sequence level, the others run at token level.
LOSS_TYPES = (
    ("grpo", "token"),
    ("bnpo", "token"),
    ("dr_grpo", "token"),
    ("dapo", "token"),
    ("cispo", "token"),
    ("sapo", "token"),
    ("luspo", "sequence"),
    ("vespo", "token"),
    ("grpo", "sequence"),
)
PROMPT_LEN, COMPLETION_LEN, ROWS = 5, 6, 4


def toy_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Reward = how often token "t5" appears in the completion (a deterministic toy)."""
    return [float(str(c).split().count("t5")) for c in completions]


def id_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Reward = the mean token id of the completion / 128: differs between a prompt's generations, so the
    advantages (and the loss) are not zero."""
    ids = [[int(w[1:]) for w in str(c).split() if w[1:].isdigit()] for c in completions]
    return [sum(i) / (128 * max(len(i), 1)) for i in ids]


def _dataset(n: int = 8):
    from datasets import Dataset

    g = torch.Generator().manual_seed(7)
    rows = []
    for i in range(n):
        ids = torch.randint(3, 128, (2 + i % 3,), generator=g).tolist()
        rows.append({"prompt": " ".join(f"t{t}" for t in ids)})
    return Dataset.from_list(rows)


def _skewed(cls: type) -> type:
    """A subclass whose generated completions differ from an SP peer's, below the SP patch (which
    hf_longctx installs on the instance while the trainer is constructed)."""

    def _generate_single_turn(self, *args: Any, **kwargs: Any):
        completion_ids, logprobs = cls._generate_single_turn(self, *args, **kwargs)
        return [ids[::-1] + [3] for ids in completion_ids], logprobs

    return type(f"Skewed{cls.__name__}", (cls,), {"_generate_single_turn": _generate_single_turn})


def _prompt_seeded(cls: type) -> type:
    """A subclass whose sampling is seeded by the prompts it is given (below the SP patch): the same completions
    with and without SP however the global RNG was used before, so an SP run can be compared with one without."""

    def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(repr(prompt_ids).encode()))
            return cls._generate_single_turn(self, prompt_ids, *args, **kwargs)

    return type(f"PromptSeeded{cls.__name__}", (cls,), {"_generate_single_turn": _generate_single_turn})


def _trainer(
    out_dir: str,
    sp: int,
    skew: bool = False,
    seeded: bool = False,
    model: Any = None,
    reward=toy_reward,
    sp_options: dict | None = None,
    base: type | None = None,
    trainer_kwargs: dict | None = None,
    builder: Any = grpo_config,
    **overrides: Any,
):
    """`base` (GRPOTrainer by default) on the tiny Llama and `_dataset()`, its config built by `builder` (`grpo_config`,
    or `rloo_config` for an RLOOTrainer) from `_trainer_fields` and `overrides`."""
    from trl import GRPOTrainer

    base = base or GRPOTrainer
    parallelism = hf_longctx.ParallelismConfig(sp_size=sp, **(sp_options or {})) if sp > 1 else None
    args = builder(**{**_trainer_fields(out_dir), "parallelism_config": parallelism, **overrides})
    cls = _skewed(base) if skew else _prompt_seeded(base) if seeded else base
    trainer = cls(
        model=tiny_model("llama") if model is None else model,
        reward_funcs=reward,
        args=args,
        train_dataset=_dataset(),
        processing_class=tiny_tokenizer(),
        **(trainer_kwargs or {}),
    )
    return trainer


def _trainer_fields(out_dir: str) -> dict[str, Any]:
    """The GRPOConfig fields every job starts from."""
    return dict(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        seed=1,
        bf16=False,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=COMPLETION_LEN,
        max_steps=2,
        optim="sgd",
        learning_rate=0.1,
        max_grad_norm=1e9,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
    )


def _fixed_inputs() -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded completions (11 tokens: odd, so SP pads), advantages, old log-probs."""
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, 128, (ROWS, PROMPT_LEN), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    for row, pad in enumerate((0, 2, 1, 3)):
        prompt_mask[row, :pad] = 0
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(3, 128, (ROWS, COMPLETION_LEN), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    for row, n in enumerate((6, 4, 5, 2)):
        completion_mask[row, n:] = 0
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]),
        # Off-policy old log-probs: ratios away from 1, so clipping and the IS weights matter.
        "old_per_token_logps": -4.8 + 0.3 * torch.randn(ROWS, COMPLETION_LEN, generator=g),
    }


def loss_job(
    rank: int, world_size: int, out_dir: str, sp_options: dict | None = None, peft: bool = False
) -> dict[str, Any]:
    """Loss, grad_norm and every parameter's gradient of one `_compute_loss` per loss type (`peft`: of the
    LoRA adapters of `_trl_jobs.lora_model()`)."""
    model = None
    if peft:
        from tests.dist._trl_jobs import lora_model

        model = lora_model()
    trainer = _trainer(os.path.join(out_dir, "loss"), world_size, sp_options=sp_options, model=model)
    model = trainer.accelerator.prepare(trainer.model)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by train() at each step
    inputs = _fixed_inputs()
    # As TRL computes it: the token count gathered over every rank.
    inputs["num_items_in_batch"] = trainer.accelerator.gather(inputs["completion_mask"].sum()).sum()
    results: dict[str, Any] = {"attn": trainer.model.config._attn_implementation}
    for loss_type, level in LOSS_TYPES:
        trainer.loss_type, trainer.importance_sampling_level = loss_type, level
        model.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(model, dict(inputs))
        trainer.accelerator.backward(loss)
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        results[f"{loss_type}/{level}"] = {"loss": loss.item(), "grad_norm": norm.item(), "grads": grads}
    return results


def train_job(rank: int, world_size: int, out_dir: str, diverge: bool = False) -> dict[str, Any]:
    """A real 2-step `train()` (generation with transformers); `diverge`: rank 1 samples other completions."""
    trainer = _trainer(os.path.join(out_dir, "train"), world_size, skew=diverge and rank == 1)
    trainer.train()
    logs = [
        {k: v for k, v in entry.items() if k in ("loss", "grad_norm", "reward")}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    return {"global_step": trainer.state.global_step, "logs": logs}


EVAL_KEYS = ("loss", "reward", "completions/mean_length", "kl")
TRAIN_KEYS = ("loss", "grad_norm", "reward", "kl")


def eval_job(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """2 training steps, then `trainer.evaluate()`, with prompt-seeded generation, a varying reward and a KL
    term (beta > 0: a reference model, which TRL loads from the policy's path), so the eval loss reads the
    sharded log-probs of a trained policy and of the reference."""
    path = os.path.join(out_dir, "policy")
    if rank == 0:
        tiny_model("llama").save_pretrained(path)
    torch.distributed.barrier()
    trainer = _trainer(
        os.path.join(out_dir, "eval"),
        world_size,
        seeded=True,
        model=path,
        reward=id_reward,
        beta=0.5,
        per_device_eval_batch_size=2,
    )
    trainer.train()
    metrics = trainer.evaluate(_dataset(6))
    train = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {
        "eval": {key: metrics[f"eval_{key}"] for key in EVAL_KEYS},
        "train": [{key: entry[key] for key in TRAIN_KEYS} for entry in train],
    }


def reference_job(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """The world-1 side: the loss passes (plain and LoRA) and the train + evaluate run."""
    return {
        **loss_job(rank, world_size, out_dir),
        "lora": loss_job(rank, world_size, os.path.join(out_dir, "lora"), peft=True),
        "eval_run": eval_job(rank, world_size, out_dir),
    }


def sp_job(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """Everything the SP=2 side checks, in one spawn: the loss pass, a real train, and diverging ranks."""
    result = {
        "loss": loss_job(rank, world_size, out_dir),
        # Ring attention: zigzag shards, whose all-gather in rank order is not sequence order.
        "loss_ring": loss_job(rank, world_size, os.path.join(out_dir, "ring"), {"sp_backend": "ring"}),
        "loss_lora_ring": loss_job(rank, world_size, os.path.join(out_dir, "lora"), {"sp_backend": "ring"}, peft=True),
        "train": train_job(rank, world_size, out_dir),
        "eval_run": eval_job(rank, world_size, out_dir),
    }
    try:
        train_job(rank, world_size, os.path.join(out_dir, "diverge"), diverge=True)
        result["diverge"] = None
    except ValueError as exc:
        result["diverge"] = str(exc)
    result["refusals"] = refusal_job(rank, world_size, os.path.join(out_dir, "refused"))
    return result


def refusal_job(rank: int, world_size: int, out_dir: str) -> dict[str, str | None]:
    """The message each GRPO setup without an exact SP path raises while the trainer is built (None: built)."""
    from trl import GRPOConfig, GRPOTrainer

    def sized_by_every_process() -> None:
        # As a script that parses a GRPOConfig and sets parallelism_config afterwards: TRL counted 2 DP ranks.
        args = GRPOConfig(**_trainer_fields(out_dir))
        args.parallelism_config = hf_longctx.ParallelismConfig(sp_size=world_size)
        GRPOTrainer(model=tiny_model("llama"), reward_funcs=toy_reward, args=args, train_dataset=_dataset(),
                    processing_class=tiny_tokenizer())  # fmt: skip

    def rollout_func() -> None:
        _trainer(out_dir, world_size, trainer_kwargs={"rollout_func": lambda prompts, trainer: {}})

    messages: dict[str, str | None] = {}
    for name, build in (("sized_by_every_process", sized_by_every_process), ("rollout_func", rollout_func)):
        try:
            build()
            messages[name] = None
        except ValueError as exc:
            messages[name] = str(exc)
    return messages

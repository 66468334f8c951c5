"""Which TRL trainers run exactly under hf_longctx SP, decided once per Trainer at construction.

A trainer's loss decides: SFT's token mean is exact on shards (hf_longctx's labels are shifted on the
full sequence), but a loss built from per-sequence quantities (DPO's summed log-probabilities, a reward
model's last-token score) or from generated samples needs its own SP path, and silently computing it
per shard would be wrong. So every TRL trainer is looked up here: supported ones may set up their SP
path, anything else (a TRL trainer this registry does not know included) raises `NotImplementedError`
naming the trainer and what works instead, before any step runs.

Where each supported trainer counts processes as data-parallel ranks, and where SP gets the DP view:

- All (transformers' Trainer loop): sampling and the batch split by DP rank and size (`trainer/dataloader.py`);
  steps, epochs and the total batch size (`trainer/patches.py`: `get_total_train_batch_size`, `get_sp_size`);
  `num_items_in_batch`, which Trainer gathers over every process from per-shard counts (the shards of an SP
  group hold disjoint tokens: each counts once); evaluation gathers over the DP group (`trainer/evaluation.py`).
- SFTTrainer: its metrics (`mean_token_accuracy`, `entropy`, `num_tokens`) are per-shard sums passed to
  `gather_for_metrics`, which adds them over the SP group before the DP gather (`trainer/metrics.py`).
- DPOTrainer (`dpo._log_metrics`): per-token metrics as SFT's; per-pair values are whole on every SP rank and
  gathered over every process for means only, which repeating each DP rank's rows `sp_size` times leaves equal.
- KTOTrainer (`kto.py`): per-token metrics as SFT's; its KL estimate and per-row sums are whole on every SP rank
  and gathered over the DP group only (TRL gathers them over every process with `gather_for_metrics`).
- RewardTrainer (`reward.py`): token counts from per-shard sums; whole scores gathered for min / mean / max only.
- GRPOTrainer, RLOOTrainer (`online.py`): generation sizes (`grpo_config` / `rloo_config`, checked at
  construction), the sampling RNG (`grpo_generation.py`), and every rank, size and gather of its batch and loss
  code (`grpo_data_parallel.py`): its statistics (std, leave-one-out baselines, quantiles) are not invariant
  under repetition, so they must see each sample once.
- DistillationTrainer: its sampler sizes, generation, completion metrics and token count in the data-parallel view
  (`distillation.py`); its loss and entropy per shard, from partial sums (`distillation_loss.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_longctx.integrations.trl.errors import UnsupportedSetup

# A user's trainer built directly on these is judged like transformers' Trainer.
_GENERIC = {"_BaseTrainer", "BaseTrainer"}


@dataclass(frozen=True)
class Support:
    """One trainer's verdict: `setup(trainer, state)` prepares (or refines the refusal of) a supported one."""

    supported: bool
    reason: str = ""
    setup: Callable[[Any, Any], None] | None = None


def _setup_reward(trainer: Any, state: Any) -> None:
    from hf_longctx.integrations.trl.reward import setup_reward

    setup_reward(trainer, state)


def _setup_dpo(trainer: Any, state: Any) -> None:
    from hf_longctx.integrations.trl.dpo import setup_dpo

    state.undo.append(setup_dpo(trainer, state))


def _setup_kto(trainer: Any, state: Any) -> None:
    from hf_longctx.integrations.trl.kto import setup_kto

    state.undo.append(setup_kto(trainer, state))


def _setup_grpo(trainer: Any, state: Any) -> None:
    from hf_longctx.integrations.trl.grpo import install_grpo_sp

    state.undo.append(install_grpo_sp(trainer, state))


def _setup_rloo(trainer: Any, state: Any) -> None:
    from hf_longctx.integrations.trl.rloo import install_rloo_sp

    state.undo.append(install_rloo_sp(trainer, state))


def _setup_distillation(trainer: Any, state: Any) -> None:
    from hf_longctx.integrations.trl.distillation import install_distillation_sp

    state.undo.append(install_distillation_sp(trainer, state))


_GENERATION = "it builds its training batch from generated completions inside the trainer"
_PER_SEQUENCE = "its loss uses per-sequence log-probabilities, which each SP rank holds only part of"

REGISTRY: dict[str, Support] = {
    "SFTTrainer": Support(True),
    "DPOTrainer": Support(True, setup=_setup_dpo),
    "RewardTrainer": Support(True, setup=_setup_reward),
    # Built through `hf_longctx.integrations.trl.grpo.grpo_config` (TRL's GRPOConfig refuses sp_size > 1).
    "GRPOTrainer": Support(True, setup=_setup_grpo),
    # Built through `hf_longctx.integrations.trl.rloo.rloo_config` (TRL's RLOOConfig refuses sp_size > 1).
    "RLOOTrainer": Support(True, setup=_setup_rloo),
    "OnlineDPOTrainer": Support(False, _GENERATION),
    "GMPOTrainer": Support(False, _GENERATION),
    "AsyncGRPOTrainer": Support(False, _GENERATION),
    "A2POTrainer": Support(False, _GENERATION),
    "SDFTTrainer": Support(False, _GENERATION),
    "SDPOTrainer": Support(False, _GENERATION),
    "IWOPDTrainer": Support(False, _GENERATION),
    "TPOTrainer": Support(False, _GENERATION),
    "GKDTrainer": Support(
        False,
        "it generates completions inside training_step (with probability lmbda, or from the teacher with seq_kd) "
        "after the batch was sharded, and its loss shifts the labels inside each row of its full logits, which on SP "
        "shards drops every shard's last target (use DistillationTrainer: exact under SP, it covers GKD with "
        "lmbda=1, temperature=1)",
    ),
    "GOLDTrainer": Support(False, _GENERATION + " and compares teacher and student logits per token"),
    # Built through `hf_longctx.integrations.trl.distillation.distillation_config` (TRL refuses sp_size > 1).
    "DistillationTrainer": Support(True, setup=_setup_distillation),
    "AsyncDistillationTrainer": Support(False, _GENERATION),
    "ServerDistillationTrainer": Support(False, _GENERATION),
    "PPOTrainer": Support(False, _GENERATION),
    "XPOTrainer": Support(False, _GENERATION),
    "NashMDTrainer": Support(False, _GENERATION),
    "KTOTrainer": Support(True, setup=_setup_kto),
    "ORPOTrainer": Support(False, _PER_SEQUENCE),
    "CPOTrainer": Support(False, _PER_SEQUENCE),
    "BCOTrainer": Support(False, _PER_SEQUENCE),
    "PRMTrainer": Support(False, "its loss reads per-step token labels the SP shards split"),
}


def supported_summary() -> str:
    """What works under SP, for error messages."""
    names = sorted(name for name, s in REGISTRY.items() if s.supported)
    return (
        "transformers' Trainer (and subclasses), "
        + ", ".join(names)
        + " (see the support matrix in hf_longctx's README and docs/trainers.md);"
        + " or train without parallelism_config / with sp_size=1"
    )


def trainer_verdict(trainer_cls: type) -> tuple[str, Support]:
    """The TRL trainer `trainer_cls` is judged as (the first TRL class in its MRO) and its verdict.

    A class outside TRL on top of transformers' Trainer only is `("Trainer", supported)`; a TRL trainer
    missing from `REGISTRY` is refused (it may have a loss SP would shard silently).
    """
    for cls in trainer_cls.__mro__:
        if not cls.__module__.split(".")[0] == "trl":
            continue
        if cls.__name__ in _GENERIC:
            break
        if cls.__name__ in REGISTRY:
            return cls.__name__, REGISTRY[cls.__name__]
        return cls.__name__, Support(False, "hf_longctx has not checked this TRL trainer under SP")
    return "Trainer", Support(True)


def refuse(name: str, reason: str) -> NotImplementedError:
    """The error for a trainer (or one of its options) without an exact SP path."""
    return NotImplementedError(
        f"{name} is not supported with hf_longctx sequence parallelism: {reason}, so sharding its sequences "
        f"would give a wrong loss. What works under SP: {supported_summary()}."
    )


def check_trainer_class(trainer_cls: type) -> Support:
    """The verdict for a supported trainer class.

    Raises:
        NotImplementedError: naming the trainer and what works under SP.
    """
    name, verdict = trainer_verdict(trainer_cls)
    if not verdict.supported:
        raise refuse(name, verdict.reason)
    return verdict


def check_head(name: str, model: Any, verdict: Support) -> None:
    """Refuse a model whose head hf_longctx has no exact SP path for, under trainer `name`.

    The heads hf_longctx knows (`sequence/heads.py`): causal LM and conditional generation (every trainer),
    token classification and extractive QA (transformers' Trainer: their losses are taken over the whole row by
    `sequence/head_losses.py`), sequence classification (RewardTrainer, whose setup pools the last token exactly).

    Raises:
        NotImplementedError: naming the trainer, the model class and what works.
    """
    from hf_longctx.sequence import heads

    kind, cls_name = heads.head_of(model)
    known = ", ".join(heads.KNOWN)
    if kind is None:
        raise refuse(
            f"{name} with {cls_name}",
            f"hf_longctx knows the losses of these heads only: {known}; {cls_name} carries none of them (a loss "
            "it has not checked could read each rank's shard as the whole sequence)",
        )
    if kind == heads.SEQUENCE_CLASSIFICATION and verdict.setup is None:
        # Its pooling reads each sequence's last token, which only one SP rank holds: every other rank would
        # pool its own shard's last token, a silently wrong score. RewardTrainer's setup fetches it exactly.
        raise refuse(f"{name} with {cls_name}", "sequence classification pools the last token of the whole sequence")
    if kind in (heads.TOKEN_CLASSIFICATION, heads.QUESTION_ANSWERING) and name != "Trainer":
        raise refuse(
            f"{name} with {cls_name}",
            f"its loss is built for language-model heads; a {kind} model trains under SP with transformers' Trainer",
        )


def check_trainer(trainer: Any, state: Any) -> None:
    """Refuse a TRL trainer without an exact SP path, or set up the SP path of a supported one.

    Raises:
        NotImplementedError: naming the trainer (or its unsupported option) and what works.
    """
    verdict = check_trainer_class(type(trainer))
    model = getattr(trainer, "model", None)
    if getattr(model, "config", None) is not None:  # a module around one is refused at the first step (first_step.py)
        check_head(trainer_verdict(type(trainer))[0], model, verdict)
    if verdict.setup is not None:
        try:
            verdict.setup(trainer, state)
        except UnsupportedSetup as err:
            raise refuse(trainer_verdict(type(trainer))[0], str(err)) from None

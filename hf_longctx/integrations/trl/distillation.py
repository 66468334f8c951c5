"""TRL `DistillationTrainer` under hf_longctx SP: generation as GRPO's, both models' forwards sharded, and the
batch code seeing the data-parallel world of the run without SP.

TRL 1.16's `DistillationTrainer` is on-policy only: each generation batch (`per_device_train_batch_size x
gradient_accumulation_steps` prompts per process) is completed by the student, then every micro-batch's loss is a
token-level divergence between the student's and the teacher's next-token distributions.

- Sizes: TRL derives the generation batch from `accelerator.num_processes` where it builds the sampler (its config
  has no size fields). `get_train_dataloader` / `get_eval_dataloader` run in the data-parallel view
  (`grpo_data_parallel.data_parallel_view`), so the sampler is sized for the DP ranks, which draw the prompts.
- Generation (`_generate_single_turn`): on the plain model, with the sampling RNG of the run without SP, and the SP
  ranks of a group checked to have generated identical tokens (`grpo_generation`).
- Batch code (`_prepare_inputs`: generation, completion metrics, the global scored-token count): in the
  data-parallel view, so each DP rank's rows count once.
- Loss (`compute_loss`, `distillation_loss.py`): both models' forwards sharded over the SP group, the divergence
  summed on each shard and divided by TRL's global count.

TRL refuses SP in `DistillationConfig.__post_init__`; `distillation_config` builds the config with that check not
seeing SP (nothing is patched). `install_distillation_sp(trainer, state)` patches one trainer instance, reversibly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from hf_longctx._patching import Patch
from hf_longctx.distributed.groups import SequenceParallelGroups, validate_sp_size
from hf_longctx.integrations.trainer.state import SequenceParallelState, sp_hidden
from hf_longctx.integrations.trl.distillation_loss import make_compute_loss
from hf_longctx.integrations.trl.errors import UnsupportedSetup
from hf_longctx.integrations.trl.grpo_data_parallel import (
    data_parallel_view,
    make_data_parallel_step,
    make_module_gather_object,
)
from hf_longctx.integrations.trl.grpo_generation import check_same_generation, plain_model, share_sampling_rng
from hf_longctx.integrations.trl.online import keep_prompt_collate


def distillation_config(**kwargs: Any) -> Any:
    """`trl.DistillationConfig(**kwargs)` accepting an hf_longctx `parallelism_config` with `sp_size > 1`.

    TRL refuses sequence parallelism in `DistillationConfig.__post_init__` because its (transformers') input
    sharding cannot apply to the batches the trainer generates; hf_longctx shards inside the trainer instead
    (`install_distillation_sp`). Only that check is kept from seeing SP. TRL 1.16's config holds no generation
    sizes: the trainer derives them from `accelerator.num_processes`, which hf_longctx shows as the number of
    data-parallel ranks (`world / sp_size`) where the sampler is built.

    Raises:
        ValueError: the config asks for accelerate's upstream backend (`sp_backend="deepspeed"`), or `sp_size` does
            not divide the world size.
    """
    from trl import DistillationConfig

    config = kwargs.get("parallelism_config")
    if config is None or getattr(config, "sp_size", 1) == 1:
        return DistillationConfig(**kwargs)
    if getattr(config, "sp_upstream", False):
        raise ValueError(
            "DistillationTrainer under SP needs an hf_longctx backend: set sp_backend to 'ulysses', 'ring', 'hybrid' "
            "or 'auto' (accelerate's 'deepspeed' backend cannot shard generated batches)."
        )
    with sp_hidden(config):
        args = DistillationConfig(**kwargs)
    validate_sp_size(config.sp_size, args.world_size)
    return args


def check_distillation_settings(trainer: Any) -> None:
    """Refuse, by name, the DistillationTrainer options SP cannot keep exact.

    Raises:
        UnsupportedSetup: naming the option and what works.
    """
    args = trainer.args
    if getattr(args, "use_vllm", False):
        raise UnsupportedSetup(
            f"use_vllm=True (vllm_mode={args.vllm_mode!r}) has no exact SP path: the SP ranks of a group must sample "
            "the same completions with the sampling RNG of the run without SP, which hf_longctx seeds and checks "
            "for transformers' generate only (set use_vllm=False)"
        )
    if getattr(trainer, "_is_vlm", False):
        raise UnsupportedSetup(
            "a vision-language processor has no exact SP path in hf_longctx (its image features are not sharded "
            "with the rows; works under SP: a text-only model and tokenizer)"
        )


def _size_completion_log(trainer: Any, dp: int) -> None:
    """Keep TRL's completion log (`_logs`, which `__init__` sized after SP was set up) to one generation batch of
    the DP ranks, as the run without SP does: it holds the latest generation only."""
    args = trainer.args
    size = args.per_device_train_batch_size * dp * args.gradient_accumulation_steps
    logs = getattr(trainer, "_logs", {})
    for key, log in logs.items():
        if isinstance(log, deque) and log.maxlen != size:
            logs[key] = deque(log, maxlen=size)


def make_generate(trainer: Any, state: SequenceParallelState) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for `_generate_single_turn` (TRL 1.16 returns the completion ids only): the shared
    sampling RNG, the plain model, then the digest check (`grpo_generation`)."""
    generations = 0

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_single_turn(prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal generations
            if generations == 0:
                _size_completion_log(trainer, state.groups.dp_world_size)
            share_sampling_rng(state, first=generations == 0)
            generations += 1
            with plain_model(state, trainer.model):
                completion_ids = original(prompt_ids, *args, **kwargs)
            check_same_generation(state, prompt_ids, completion_ids)
            return completion_ids

        return generate_single_turn

    return make


def _make_loader(trainer: Any, groups: SequenceParallelGroups) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for `get_train_dataloader` / `get_eval_dataloader`: TRL's collate kept (prompts are
    sharded only after generation, as GRPO's), the sampler sized in the data-parallel view."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        keep_collate = keep_prompt_collate(original)

        def get_dataloader(*args: Any, **kwargs: Any) -> Any:
            with data_parallel_view(trainer, groups):
                return keep_collate(*args, **kwargs)

        return get_dataloader

    return make


_GATHER_OBJECT: list[Patch] = []
_USERS = 0  # trainers relying on the module patch


def use_module_gather_object() -> Callable[[], None]:
    """Patch `trl.trainer.distillation_trainer.gather_object` (TRL's completion log; accelerate's function, which
    has no group argument) to gather over the DP group inside a data-parallel view (once per process); returns this
    user's release, which restores it when no trainer uses it any more."""
    global _USERS
    if not _GATHER_OBJECT:
        from trl.trainer import distillation_trainer

        _GATHER_OBJECT.append(Patch(distillation_trainer, "gather_object", make_module_gather_object))
        _GATHER_OBJECT[0].apply()
    _USERS += 1
    released = False

    def release() -> None:
        global _USERS
        nonlocal released
        if released:
            return
        released = True
        _USERS -= 1
        if _USERS == 0:
            _GATHER_OBJECT.pop().remove()

    return release


def install_distillation_sp(trainer: Any, state: SequenceParallelState) -> Callable[[], None]:
    """Patch one `DistillationTrainer` instance for SP (idempotent); returns the undo.

    Runs inside `Trainer.__init__` (`_validate_args`): the teacher is not prepared yet and is looked up at every
    step.

    Raises:
        UnsupportedSetup: an option without an exact SP path (see `check_distillation_settings`).
    """
    check_distillation_settings(trainer)
    groups = state.groups
    patches = [
        Patch(trainer, "_generate_single_turn", make_generate(trainer, state)),
        # Generation and the batch's metrics and token count: each DP rank's rows once.
        Patch(trainer, "_prepare_inputs", make_data_parallel_step(trainer, groups)),
        Patch(trainer, "compute_loss", make_compute_loss(trainer, state)),
        Patch(trainer, "get_train_dataloader", _make_loader(trainer, groups)),
        Patch(trainer, "get_eval_dataloader", _make_loader(trainer, groups)),
    ]
    for patch in patches:
        patch.apply()
    release = use_module_gather_object()
    # The loss is this shard's share (its metrics partial sums) in training and whole on every SP rank in
    # evaluation; the batches the model sees are built inside the trainer (the first step checks no shard).
    state.replicated_outputs = True

    def undo() -> None:
        for patch in reversed(patches):  # the instance attributes go: the class's methods show through again
            patch.remove()
        release()

    return undo

"""TRL's online RL trainers (`GRPOTrainer`, `RLOOTrainer`) under hf_longctx SP: the config builder, the checks
and the one installer both share.

Both trainers build their training batch inside the trainer from completions they generate, with the same
structure in TRL 1.16: a generation batch sized by `generation_batch_size` / `steps_per_generation`, generation
in `_generate_single_turn`, every log-prob forward in `_get_per_token_logps_and_entropies`, rewards in
`_calculate_rewards`, and batch statistics over TRL's module-level `gather` / `gather_object`.

- Sizes: TRL counts every process as a DP rank; `online_config` sizes the generation batch by the DP ranks
  (`world / sp_size`), which draw the prompts, and the trainer refuses a config sized otherwise.
- Sampling: prompts by DP rank (`integrations/trainer/dataloader.py`) with TRL's collate (no sharding).
- Generation (`grpo_generation.py`): plain model, the sampling RNG of the run without SP, checked identical.
- Log-probs (`grpo_logps.py`): sharded forward, per-token values gathered back; TRL's loss code unchanged.
- Rewards: reward models score whole sequences on every rank, without SP attention.
- Ranks and gathers (`grpo_data_parallel.py`): inside `training_step` / `prediction_step` the accelerator and
  the trainer module's gathers count DP ranks only.

`install_online_sp(trainer, state, kind)` patches one trainer instance, reversibly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.data.collator import SequenceShardingCollator
from hf_longctx.distributed.groups import validate_sp_size
from hf_longctx.integrations.trainer.state import SequenceParallelState, sp_hidden
from hf_longctx.integrations.trl.grpo_data_parallel import make_data_parallel_step, use_module_gathers
from hf_longctx.integrations.trl.grpo_generation import make_generate, plain_model
from hf_longctx.integrations.trl.grpo_logps import make_logps


@dataclass(frozen=True)
class OnlineTrainer:
    """One TRL online trainer: its name, config class, the module whose `gather` / `gather_object` its batch code
    calls, and the hf_longctx builder of its config (named in errors)."""

    name: str
    config: str
    module: str
    builder: str

    def config_class(self) -> type:
        import trl

        return getattr(trl, self.config)


GRPO = OnlineTrainer(
    "GRPOTrainer", "GRPOConfig", "trl.trainer.grpo_trainer", "hf_longctx.integrations.trl.grpo.grpo_config(...)"
)
RLOO = OnlineTrainer(
    "RLOOTrainer", "RLOOConfig", "trl.trainer.rloo_trainer", "hf_longctx.integrations.trl.rloo.rloo_config(...)"
)


def online_config(kind: OnlineTrainer, **kwargs: Any) -> Any:
    """`kind`'s TRL config built from `kwargs`, accepting an hf_longctx `parallelism_config` with `sp_size > 1`.

    TRL refuses sequence parallelism in the config's `__post_init__` because transformers' input sharding cannot
    apply to generated batches; hf_longctx shards inside the trainer instead (`install_online_sp`). Only that check
    is kept from seeing SP (nothing is patched: the config keeps its `parallelism_config`), and
    `generation_batch_size` / `steps_per_generation` are derived as TRL derives them for a run on the
    data-parallel ranks (`world / sp_size`) only, since the SP ranks of a group share their prompts.

    Raises:
        ValueError: the config asks for accelerate's upstream backend (`sp_backend="deepspeed"`), which this
            integration does not drive, or its generation sizes do not fit the data-parallel ranks.
    """
    config_cls = kind.config_class()
    config = kwargs.get("parallelism_config")
    if config is None or getattr(config, "sp_size", 1) == 1:
        return config_cls(**kwargs)
    if getattr(config, "sp_upstream", False):
        raise ValueError(
            f"{kind.name} under SP needs an hf_longctx backend: set sp_backend to 'ulysses', 'ring', 'hybrid' or "
            "'auto' (accelerate's 'deepspeed' backend cannot shard generated batches)."
        )
    generation_batch_size = kwargs.pop("generation_batch_size", None)
    steps_per_generation = kwargs.pop("steps_per_generation", None)
    with sp_hidden(config):
        # TRL derives the sizes from every process; a provisional `steps_per_generation = num_generations`
        # passes its divisibility checks, and the sizes for the DP ranks replace it below.
        num_generations = kwargs.get("num_generations", config_cls.__dataclass_fields__["num_generations"].default)
        args = config_cls(**kwargs, steps_per_generation=num_generations)
    validate_sp_size(config.sp_size, args.world_size)
    dp = args.world_size // config.sp_size
    args.generation_batch_size, args.steps_per_generation = data_parallel_sizes(
        args, dp, generation_batch_size, steps_per_generation
    )
    check_generation_sizes(args, dp, kind.builder)
    return args


def data_parallel_sizes(
    args: Any, dp: int, generation_batch_size: int | None, steps_per_generation: int | None
) -> tuple[int, int]:
    """`(generation_batch_size, steps_per_generation)` as TRL's GRPO / RLOO configs derive them on `dp` processes.

    Raises:
        ValueError: both are given, or `generation_batch_size` is not a multiple of the DP batch.
    """
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(
            "'generation_batch_size' and 'steps_per_generation' can not be both configured at the same time"
        )
    step = args.per_device_train_batch_size * dp
    if generation_batch_size is None:
        steps = steps_per_generation or args.gradient_accumulation_steps
        return step * steps, steps
    if generation_batch_size % step:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) must be divisible by the global batch size ({step}): "
            f"per_device_train_batch_size x {dp} data-parallel rank(s) (world size / sp_size under SP)."
        )
    return generation_batch_size, generation_batch_size // step


def check_generation_sizes(args: Any, dp: int, builder: str = GRPO.builder) -> None:
    """Refuse generation sizes that do not describe a run on `dp` data-parallel ranks, by name.

    Raises:
        ValueError: `generation_batch_size` counts SP ranks as DP ranks (a config built without `builder` or
            changed after it), holds partial prompt groups, or the eval batch does (checked as TRL checks).
    """
    gbs, steps, per_device = args.generation_batch_size, args.steps_per_generation, args.per_device_train_batch_size
    if gbs != per_device * dp * steps:
        raise ValueError(
            f"generation_batch_size={gbs} with steps_per_generation={steps} does not count the {dp} data-parallel "
            f"rank(s) that draw prompts under SP (expected per_device_train_batch_size {per_device} x {dp} x "
            f"{steps} = {per_device * dp * steps}; a config built before SP was set counts every process): "
            f"build the config with {builder}, with parallelism_config, and do not change those fields after."
        )
    if gbs % args.num_generations:
        raise ValueError(
            f"generation_batch_size ({gbs}) must be divisible by num_generations ({args.num_generations})."
        )
    num_generations = args.num_generations_eval or args.num_generations
    if args.do_eval and args.eval_strategy != "no" and (args.per_device_eval_batch_size * dp) % num_generations:
        raise ValueError(
            f"The global eval batch size ({args.per_device_eval_batch_size} * {dp} data-parallel rank(s)) must be "
            f"divisible by the number of generations used for evaluation ({num_generations})."
        )


def check_online_settings(trainer: Any, dp: int, kind: OnlineTrainer) -> None:
    """Refuse, by name, the options of `kind` that SP cannot keep exact.

    Raises:
        ValueError: naming the option to change.
    """
    name, args = kind.name, trainer.args
    if getattr(args, "use_vllm", False):
        raise ValueError(f"{name} under SP generates with transformers only: set use_vllm=False.")
    if getattr(trainer, "rollout_func", None) is not None:
        raise ValueError(
            f"{name} under SP generates with transformers only (the SP ranks of a group must sample the same "
            "completions, which hf_longctx seeds and checks there): pass rollout_func=None."
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        # Continuous batching switches the model to paged attention while it generates; hf_longctx has not
        # checked that the SP attention it switches back to, or the sampling, stay as without SP.
        raise ValueError(
            f"{name} under SP generates with transformers' generate(): set use_transformers_continuous_batching=False."
        )
    if getattr(trainer, "_is_vlm", False):
        raise ValueError(
            f"{name} under SP shards text-only policy forwards, and processing_class is a processor "
            f"({type(trainer.processing_class).__name__}: a vision-language model): train it with sp_size=1."
        )
    check_generation_sizes(args, dp, kind.builder)


def keep_prompt_collate(original: Callable[..., Any]) -> Callable[..., Any]:
    """The `Patch` factory for `get_train_dataloader` / `get_eval_dataloader` of a trainer that generates: its
    loaders keep TRL's collate (prompts are sharded only after generation)."""

    def get_dataloader(*args: Any, **kwargs: Any) -> Any:
        # The batches are prompts (a list of dicts), sharded only after generation: keep TRL's collate.
        loader = original(*args, **kwargs)
        # accelerate's loader adapts `base_dataloader`, which is the one iterated: unwrap both.
        for obj in (loader, getattr(loader, "base_dataloader", None)):
            if obj is not None and isinstance(obj.__dict__.get("collate_fn"), SequenceShardingCollator):
                obj.collate_fn = obj.collate_fn.collate_fn
        return loader

    return get_dataloader


@contextlib.contextmanager
def _plain_models(state: SequenceParallelState, models: list[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(plain_model(state, model))
        yield


def _make_rewards(trainer: Any, state: SequenceParallelState) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for `_calculate_rewards`: reward models (`nn.Module` reward functions) score the whole
    prompt + completion on every rank, so they run without the SP attention their `prepare_model` gave them (with
    it, their forward on whole, unsharded rows raised for missing shard positions; measured under DDP)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def calculate_rewards(*args: Any, **kwargs: Any) -> Any:
            models = [f for f in trainer.reward_funcs if isinstance(f, torch.nn.Module)]
            with _plain_models(state, models):
                return original(*args, **kwargs)

        return calculate_rewards

    return make


def install_online_sp(trainer: Any, state: SequenceParallelState, kind: OnlineTrainer) -> Callable[[], None]:
    """Patch one `kind` trainer instance for SP (idempotent); returns the undo.

    Raises:
        ValueError: an option SP cannot keep exact (see `check_online_settings`).
    """
    check_online_settings(trainer, state.groups.dp_world_size, kind)
    data_parallel = make_data_parallel_step(trainer, state.groups)
    patches = [
        Patch(trainer, "_get_per_token_logps_and_entropies", make_logps(trainer, state, kind.name)),
        Patch(trainer, "_generate_single_turn", make_generate(trainer, state)),
        Patch(trainer, "_calculate_rewards", _make_rewards(trainer, state)),
        # The public entries into the batch and loss code: both run in the data-parallel view.
        Patch(trainer, "training_step", data_parallel),
        Patch(trainer, "prediction_step", data_parallel),
        Patch(trainer, "get_train_dataloader", keep_prompt_collate),
        Patch(trainer, "get_eval_dataloader", keep_prompt_collate),
    ]
    for patch in patches:
        patch.apply()
    release_gathers = use_module_gathers(kind.module)
    state.replicated_outputs = True  # the loss comes from gathered log-probs: the same on every SP rank

    def undo() -> None:
        for patch in reversed(patches):  # the instance attributes go: the class's methods show through again
            patch.remove()
        release_gathers()

    return undo

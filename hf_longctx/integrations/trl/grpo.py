"""TRL `GRPOTrainer` under hf_longctx SP: generation on the plain model, log-probs and loss sharded, and
every batch size, rank and gather seen as by the run without SP on the data-parallel ranks.

- Sizes: TRL sizes the generation batch (`generation_batch_size`, `steps_per_generation`; its repeat sampler
  and the generations buffered across accumulation steps and `num_iterations` follow them) by counting every
  process as a DP rank. `grpo_config` sizes it by the DP ranks (`world / sp_size`), which draw the prompts;
  the trainer refuses a config sized otherwise (`check_generation_sizes`).
- Sampling: prompts are sampled by DP rank (`integrations/trainer/dataloader.py`); TRL's collate is kept
  (prompts are sharded only after generation).
- Generation (`grpo_generation.py`): plain model, the sampling RNG of the run without SP, checked identical
  across each SP group.
- Log-probs (`grpo_logps.py`): sharded forward, per-token values gathered back; TRL's loss code unchanged.
- Ranks and gathers (`grpo_data_parallel.py`): inside `training_step` / `prediction_step` the trainer's
  accelerator and TRL's module-level gathers count DP ranks only, so group statistics, the batch-wide std,
  the slice of each rank's advantages, token counts and metrics are those of the run without SP.

TRL refuses SP in `GRPOConfig.__post_init__`; `grpo_config` builds one config with that check not seeing SP
(nothing is patched). `install_grpo_sp(trainer, state)` patches one trainer instance, reversibly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hf_longctx._patching import Patch
from hf_longctx.data.collator import SequenceShardingCollator
from hf_longctx.distributed.groups import validate_sp_size
from hf_longctx.integrations.trainer.state import SequenceParallelState, sp_hidden
from hf_longctx.integrations.trl.grpo_data_parallel import make_data_parallel_step, use_module_gathers
from hf_longctx.integrations.trl.grpo_generation import make_generate
from hf_longctx.integrations.trl.grpo_logps import make_logps

_GRPO_CONFIG = "hf_longctx.integrations.trl.grpo.grpo_config(...)"


def grpo_config(**kwargs: Any) -> Any:
    """`trl.GRPOConfig(**kwargs)` accepting an hf_longctx `parallelism_config` with `sp_size > 1`.

    TRL refuses sequence parallelism in `GRPOConfig.__post_init__` because its own (transformers')
    input sharding cannot apply to generated batches; hf_longctx shards inside the trainer instead
    (`install_grpo_sp`). Only that check is kept from seeing SP, and `generation_batch_size` /
    `steps_per_generation` are derived as TRL derives them for a run on the data-parallel ranks
    (`world / sp_size`) only, since the SP ranks of a group share their prompts.

    Raises:
        ValueError: the config asks for accelerate's upstream backend (`sp_backend="deepspeed"`), which this
            integration does not drive, or its generation sizes do not fit the data-parallel ranks.
    """
    from trl import GRPOConfig

    config = kwargs.get("parallelism_config")
    if config is None or getattr(config, "sp_size", 1) == 1:
        return GRPOConfig(**kwargs)
    if getattr(config, "sp_upstream", False):
        raise ValueError(
            "GRPOTrainer under SP needs an hf_longctx backend: set sp_backend to 'ulysses', 'ring', 'hybrid' or "
            "'auto' (accelerate's 'deepspeed' backend cannot shard generated batches)."
        )
    generation_batch_size = kwargs.pop("generation_batch_size", None)
    steps_per_generation = kwargs.pop("steps_per_generation", None)
    with sp_hidden(config):
        # TRL derives the sizes from every process; a provisional `steps_per_generation = num_generations`
        # passes its divisibility checks, and the sizes for the DP ranks replace it below.
        num_generations = kwargs.get("num_generations", GRPOConfig.__dataclass_fields__["num_generations"].default)
        args = GRPOConfig(**kwargs, steps_per_generation=num_generations)
    validate_sp_size(config.sp_size, args.world_size)
    dp = args.world_size // config.sp_size
    args.generation_batch_size, args.steps_per_generation = data_parallel_sizes(
        args, dp, generation_batch_size, steps_per_generation
    )
    check_generation_sizes(args, dp)
    return args


def data_parallel_sizes(
    args: Any, dp: int, generation_batch_size: int | None, steps_per_generation: int | None
) -> tuple[int, int]:
    """`(generation_batch_size, steps_per_generation)` as `GRPOConfig` derives them on `dp` processes.

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


def check_generation_sizes(args: Any, dp: int) -> None:
    """Refuse generation sizes that do not describe a run on `dp` data-parallel ranks, by name.

    Raises:
        ValueError: `generation_batch_size` counts SP ranks as DP ranks (a config built without `grpo_config`
            or changed after it), holds partial prompt groups, or the eval batch does (checked as TRL checks).
    """
    gbs, steps, per_device = args.generation_batch_size, args.steps_per_generation, args.per_device_train_batch_size
    if gbs != per_device * dp * steps:
        raise ValueError(
            f"generation_batch_size={gbs} with steps_per_generation={steps} does not count the {dp} data-parallel "
            f"rank(s) that draw prompts under SP (expected per_device_train_batch_size {per_device} x {dp} x "
            f"{steps} = {per_device * dp * steps}; a GRPOConfig built before SP was set counts every process): "
            f"build the config with {_GRPO_CONFIG}, with parallelism_config, and do not change those fields after."
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


def check_grpo_settings(trainer: Any, dp: int) -> None:
    """Refuse, by name, the GRPO options SP cannot keep exact.

    Raises:
        ValueError: naming the option to change.
    """
    if getattr(trainer.args, "use_vllm", False):
        raise ValueError("GRPOTrainer under SP generates with transformers only: set use_vllm=False.")
    if getattr(trainer, "rollout_func", None) is not None:
        raise ValueError(
            "GRPOTrainer under SP generates with transformers only (the SP ranks of a group must sample the same "
            "completions, which hf_longctx seeds and checks there): pass rollout_func=None."
        )
    check_generation_sizes(trainer.args, dp)


def _make_loader(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_dataloader(*args: Any, **kwargs: Any) -> Any:
        # GRPO batches are prompts (a list of dicts), sharded only after generation: keep TRL's collate.
        loader = original(*args, **kwargs)
        # accelerate's loader adapts `base_dataloader`, which is the one iterated: unwrap both.
        for obj in (loader, getattr(loader, "base_dataloader", None)):
            if obj is not None and isinstance(obj.__dict__.get("collate_fn"), SequenceShardingCollator):
                obj.collate_fn = obj.collate_fn.collate_fn
        return loader

    return get_dataloader


def install_grpo_sp(trainer: Any, state: SequenceParallelState) -> Callable[[], None]:
    """Patch one `GRPOTrainer` instance for SP (idempotent); returns the undo.

    Raises:
        ValueError: a GRPO option SP cannot keep exact (see `check_grpo_settings`).
    """
    check_grpo_settings(trainer, state.groups.dp_world_size)
    data_parallel = make_data_parallel_step(trainer, state.groups)
    patches = [
        Patch(trainer, "_get_per_token_logps_and_entropies", make_logps(trainer, state)),
        Patch(trainer, "_generate_single_turn", make_generate(trainer, state)),
        # The public entries into GRPO's batch and loss code: both run in the data-parallel view.
        Patch(trainer, "training_step", data_parallel),
        Patch(trainer, "prediction_step", data_parallel),
        Patch(trainer, "get_train_dataloader", _make_loader),
        Patch(trainer, "get_eval_dataloader", _make_loader),
    ]
    for patch in patches:
        patch.apply()
    release_gathers = use_module_gathers()
    state.replicated_outputs = True  # the loss comes from gathered log-probs: the same on every SP rank

    def undo() -> None:
        for patch in reversed(patches):  # the instance attributes go: the class's methods show through again
            patch.remove()
        release_gathers()

    return undo

"""TRL `GRPOTrainer` under hf_longctx SP: generation on the plain model, log-probs and loss sharded.

Generation stays outside SP: every rank generates as TRL does (the SP ranks of a group hold the same
prompts and the same RNG state, so they agree; that is checked after every generation, a mismatch
raises). The policy / reference log-prob forward over prompt+completion runs on sequence shards and
the per-token log-probs are all-gathered (autograd-correct: the backward sums the gradient over the
SP group), so TRL's loss code runs unchanged on the full `[B, completion]` tensor on every rank.
Every SP rank then holds the same loss; DDP averages gradients over all ranks, which is exact
because the gather's backward summed the SP ranks' contributions.

TRL refuses SP in `GRPOConfig.__post_init__`; `grpo_config` builds one config with that check not
seeing SP (nothing is patched). `install_grpo_sp(trainer, state)` patches one trainer instance.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_longctx.attention.registry import enable_sequence_parallel
from hf_longctx.data.collator import SequenceShardingCollator
from hf_longctx.data.consistency import shard_batch
from hf_longctx.data.layout import layout_indices, to_global_order
from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.distributed.comm import all_gather_object, all_gather_sequence
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.patching import Patch
from hf_longctx.integrations.trainer.state import SequenceParallelState, _unwrap, sp_hidden

_HANDLE_ATTR = "_hf_longctx_sp_handle"
# `_get_per_token_logps_and_entropies` keyword inputs of vision-language models: not sharded here.
_MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def grpo_config(**kwargs: Any) -> Any:
    """`trl.GRPOConfig(**kwargs)` accepting an hf_longctx `parallelism_config` with `sp_size > 1`.

    TRL refuses sequence parallelism in `GRPOConfig.__post_init__` because its own (transformers')
    input sharding cannot apply to generated batches; hf_longctx shards inside the trainer instead
    (`install_grpo_sp`). Only that check is kept from seeing SP; the returned config carries it.

    Raises:
        ValueError: the config asks for accelerate's upstream backend (`sp_backend="deepspeed"`),
            which this integration does not drive.
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
    with sp_hidden(config):
        return GRPOConfig(**kwargs)


def check_grpo_settings(trainer: Any) -> None:
    """Refuse, by name, the GRPO options whose result SP would change.

    The SP ranks of a group hold the same prompts, so TRL's cross-rank gathers see each sample
    `sp_size` times: group statistics stay exact when every prompt's generations sit on one rank,
    batch-wide std / quantiles would not.

    Raises:
        ValueError: naming the option to change.
    """
    args = trainer.args
    if getattr(args, "use_vllm", False):
        raise ValueError("GRPOTrainer under SP generates with transformers only: set use_vllm=False.")
    if args.scale_rewards == "batch":
        raise ValueError(
            "scale_rewards='batch' under SP would take the std over rewards that every SP rank repeats: "
            "use scale_rewards='group' or 'none'."
        )
    if getattr(args, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise ValueError(
            "multi_objective_aggregation='normalize_then_sum' under SP takes a batch-wide std over repeated "
            "rewards: use 'sum_then_normalize'."
        )
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        raise ValueError(
            "top_entropy_quantile < 1.0 under SP takes a quantile over entropies every SP rank repeats: "
            "set top_entropy_quantile=1.0."
        )
    local = args.per_device_train_batch_size * args.steps_per_generation
    if local % args.num_generations:
        raise ValueError(
            f"Under SP each rank's generation batch (per_device_train_batch_size * steps_per_generation = {local}) "
            f"must hold whole prompt groups: make it a multiple of num_generations={args.num_generations}."
        )


class _GatherSequence(torch.autograd.Function):
    """All-gather the SP shards along dim 1 into global sequence order; backward: the gradient at this rank's
    positions times the group size.

    The shards follow the backend's token layout (zigzag for ring and hybrid: an all-gather in rank order is
    not sequence order). Every SP rank computes the same loss from the same gathered tensor, so the incoming
    gradients are identical on every rank and their sum over the group (the exact adjoint) is `size` times
    this rank's own: a constant instead of a collective in backward (as `hf_longctx.loss`'s group sum does).
    The DP engine's average over all ranks then gives the single-device gradient.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups: SequenceParallelGroups) -> torch.Tensor:
        gathered = all_gather_sequence(x.contiguous(), groups.sp_group, dim=1)
        layout, size = groups.layout, groups.sp_world_size
        ctx.size = size
        ctx.positions = layout_indices(layout, groups.sp_rank, size, gathered.shape[1]).to(x.device)
        return to_global_order(gathered, layout, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad.index_select(1, ctx.positions) * ctx.size).contiguous(), None


def _sharded_logps(
    state: SequenceParallelState, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the completion, `[B, keep]`, from a sharded forward.

    TRL's rows are left-padded prompts followed by right-padded completions; SP attention is causal
    over global positions and needs right padding, so each row is rotated to start at its first real
    token, keeping the positions the unsharded forward uses, and rotated back afterwards.
    """
    groups = state.groups
    bs, sl = input_ids.shape
    mask = attention_mask.long()
    left = (mask.cumsum(1) == 0).sum(1, keepdim=True)
    steps = torch.arange(sl, device=input_ids.device).expand(bs, sl)
    rotate = (steps + left) % sl
    labels = input_ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[:, : sl - keep] = IGNORE_INDEX  # only the completion is scored, as in TRL
    batch = {
        "input_ids": input_ids.gather(1, rotate),
        "attention_mask": mask.gather(1, rotate),
        "position_ids": steps + left,
        "labels": labels.gather(1, rotate),
    }
    shard = shard_batch(batch, groups, pad_token_id=0)
    outputs = model(**shard, fused_lm_head=True)
    # The rotation wraps left padding to the end; its (ignored) labels make those values 0.
    back = (steps - left) % sl

    def full(x: torch.Tensor) -> torch.Tensor:
        gathered = _GatherSequence.apply(x, groups)[:, :sl]
        # Position t scores token t+1: the completion tokens are scored at [sl-1-keep, sl-1).
        return gathered.gather(1, back)[:, sl - 1 - keep : sl - 1]

    entropy = outputs.entropy
    return full(outputs.log_probs), None if entropy is None else full(entropy)


def _make_logps(trainer: Any, state: SequenceParallelState) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
        ):
            if getattr(_unwrap(model), _HANDLE_ATTR, None) is None:
                return original(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs)
            given = [k for k in (*_MULTIMODAL, "compute_aux_loss") if kwargs.get(k) not in (None, False)]
            if given:
                raise ValueError(
                    f"GRPOTrainer under SP shards text-only policy forwards; got {given} (vision inputs or the MoE "
                    "aux loss): train this model with sp_size=1."
                )
            batch_size = batch_size or input_ids.size(0)
            logps, entropies = [], []
            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                with trainer.accelerator.autocast():
                    lp, ent = _sharded_logps(state, model, input_ids[rows], attention_mask[rows], logits_to_keep)
                logps.append(lp)
                entropies.append(ent)
            entropy = torch.cat(entropies, dim=0) if compute_entropy else None
            return torch.cat(logps, dim=0), entropy, None

        return get_per_token_logps_and_entropies

    return make


@contextlib.contextmanager
def plain_model(state: SequenceParallelState, model: Any) -> Iterator[None]:
    """Run `model` without its SP attention inside the block (generation), then re-enable it."""
    model = _unwrap(model)
    index = next((i for i, h in enumerate(state.handles) if getattr(h, "model", None) is model), None)
    if index is None or getattr(model, _HANDLE_ATTR, None) is None:
        yield
        return
    state.handles[index].remove()
    try:
        yield
    finally:
        state.handles[index] = enable_sequence_parallel(model, state.groups, **state.config.attention_options())


def check_same_generation(state: SequenceParallelState, prompt_ids: Any, completion_ids: Any) -> None:
    """Raise unless every SP rank of the group generated the same completions for the same prompts."""
    digest = hashlib.sha256(repr((prompt_ids, completion_ids)).encode()).hexdigest()
    digests = all_gather_object(digest, state.groups.sp_group)
    if len(set(digests)) > 1:
        raise ValueError(
            f"The SP ranks of this group generated different completions (digests {digests}); they must "
            "sample identically: same seed on every rank, deterministic kernels, and no rank-dependent sampling."
        )


def share_sampling_rng(state: SequenceParallelState) -> None:
    """Give every SP rank of the group its SP rank 0's RNG state (CPU and the current CUDA device).

    GRPOTrainer seeds each rank differently (`set_seed(seed, device_specific=True)`), so DP ranks
    sample different completions; the SP ranks of a group must sample the same ones.
    """
    local = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        local.append(torch.cuda.get_rng_state())
    first = all_gather_object(local, state.groups.sp_group)[0]
    torch.set_rng_state(first[0])
    if len(first) > 1:
        torch.cuda.set_rng_state(first[1])


def _make_generate(trainer: Any, state: SequenceParallelState) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_single_turn(prompt_ids, *args, **kwargs):
            share_sampling_rng(state)
            with plain_model(state, trainer.model):
                completion_ids, logprobs = original(prompt_ids, *args, **kwargs)
            check_same_generation(state, prompt_ids, completion_ids)
            return completion_ids, logprobs

        return generate_single_turn

    return make


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
    check_grpo_settings(trainer)
    patches = [
        Patch(trainer, "_get_per_token_logps_and_entropies", _make_logps(trainer, state)),
        Patch(trainer, "_generate_single_turn", _make_generate(trainer, state)),
        Patch(trainer, "get_train_dataloader", _make_loader),
        Patch(trainer, "get_eval_dataloader", _make_loader),
    ]
    for patch in patches:
        patch.apply()
    state.replicated_outputs = True  # the loss comes from gathered log-probs: the same on every SP rank

    def undo() -> None:
        for patch in reversed(patches):  # the instance attributes go: the class's methods show through again
            patch.remove()

    return undo

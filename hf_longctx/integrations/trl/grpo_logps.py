"""GRPO's and RLOO's policy / reference log-probs under SP: a sharded forward, the per-token values gathered back.

`make_logps(trainer, state)` builds the replacement of `_get_per_token_logps_and_entropies`
(TRL's one entry for every log-prob forward: old, reference and policy): each row of prompt + completion
runs sharded over the SP group and the completion's per-token log-probs (and entropies) are all-gathered
back into sequence order, autograd-correct, so TRL's loss code runs unchanged on the full `[B, completion]`
tensors on every SP rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.attention.registry import _HANDLE_ATTR
from hf_longctx.data.consistency import shard_batch
from hf_longctx.data.layout import layout_indices, to_global_order
from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.distributed.comm import all_gather_sequence
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.trainer.state import SequenceParallelState, _unwrap
from hf_longctx.sequence.replicated import mark_replicated

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
    state: SequenceParallelState,
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    keep: int,
    aux: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the completion, `[B, keep]`, from a sharded forward, and with `aux`
    the MoE router loss of the rows (whole on every SP rank, `hf_longctx.sequence.router_loss`).

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
    outputs = model(**shard, fused_lm_head=True, **({"output_router_logits": True} if aux else {}))
    # The rotation wraps left padding to the end; its (ignored) labels make those values 0.
    back = (steps - left) % sl

    def full(x: torch.Tensor) -> torch.Tensor:
        gathered = _GatherSequence.apply(x, groups)[:, :sl]
        # Position t scores token t+1: the completion tokens are scored at [sl-1-keep, sl-1).
        return gathered.gather(1, back)[:, sl - 1 - keep : sl - 1]

    entropy = outputs.entropy
    return full(outputs.log_probs), None if entropy is None else full(entropy), outputs.aux_loss if aux else None


def make_logps(
    trainer: Any, state: SequenceParallelState, name: str = "GRPOTrainer"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for `_get_per_token_logps_and_entropies` of the TRL trainer `name`: sharded for a model
    with SP attention (the policy and a reference model), TRL's own forward for any other."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs
        ):
            if getattr(_unwrap(model), _HANDLE_ATTR, None) is None:
                return original(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, **kwargs)
            given = [k for k in _MULTIMODAL if kwargs.get(k) is not None]
            if given:
                raise ValueError(
                    f"{name} under SP shards text-only policy forwards; got vision inputs {given}: train this "
                    "model with sp_size=1."
                )
            aux = bool(kwargs.get("compute_aux_loss"))
            batch_size = batch_size or input_ids.size(0)
            logps, entropies, aux_losses = [], [], []
            for start in range(0, input_ids.size(0), batch_size):
                rows = slice(start, start + batch_size)
                with trainer.accelerator.autocast():
                    lp, ent, al = _sharded_logps(
                        state, model, input_ids[rows], attention_mask[rows], logits_to_keep, aux
                    )
                logps.append(lp)
                entropies.append(ent)
                aux_losses.append(al)
            entropy = torch.cat(entropies, dim=0) if compute_entropy else None
            # TRL averages the chunks' router losses; each is whole on every SP rank, so is their mean.
            aux_loss = mark_replicated(torch.stack(aux_losses).mean()) if aux else None
            return torch.cat(logps, dim=0), entropy, aux_loss

        return get_per_token_logps_and_entropies

    return make

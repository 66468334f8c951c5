"""RewardTrainer under SP: each sequence's score is read at its last real token, on the rank that holds it.

A sequence-classification model scores the rightmost token that is not padding. Under SP every rank holds
a slice of each row, so the model's own pooling would pick each shard's last token. Here the backbone and
the score head run on the shard, the global index of each row's last real token is agreed on with one
max-reduction over the SP group (the shard's `position_ids` are global), and the score found there is
summed over the group (`comm.group_sum`: exact gradients after the engine's average over every rank). The
loss and metrics are then computed from full, identical scores on every SP rank.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from hf_longctx._patching import Patch
from hf_longctx.distributed.comm import all_reduce_max, group_sum
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.integrations.trl.errors import UnsupportedSetup


def last_token_scores(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    pad_token_id: int,
    groups: SequenceParallelGroups,
) -> torch.Tensor:
    """`[bs, num_labels]` scores at each row's rightmost real token (not padding, not `pad_token_id`).

    Args:
        logits: `[bs, sl_l, num_labels]` score-head output of this rank's shard.
        input_ids, attention_mask, position_ids: the shard's `[bs, sl_l]` tensors; positions are global.
        pad_token_id: the model's padding id (what transformers' pooling skips).
        groups: the SP group the row is split over.

    Returns:
        The same scores on every SP rank; gradients flow only into the rank that holds the token.
    """
    positions = position_ids.to(logits.device).expand(input_ids.shape)
    real = (input_ids != pad_token_id) & (attention_mask != 0)
    local_last = torch.where(real, positions, torch.full_like(positions, -1)).amax(dim=-1)
    # A row without any real token is scored at position 0, as transformers' argmax does.
    last = all_reduce_max(local_last, groups.sp_group).clamp(min=0)
    here = (positions == last.unsqueeze(-1)).to(logits.dtype).unsqueeze(-1)
    return group_sum((logits * here).sum(dim=1), groups.sp_group, groups.sp_world_size)


def _pooled_forward(model: Any, groups: SequenceParallelGroups):
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    ref = weakref.ref(model)
    pad_token_id = model.config.get_text_config().pad_token_id

    def make(original):
        def forward(input_ids=None, attention_mask=None, position_ids=None, labels=None, **kwargs):
            if labels is not None or input_ids is None or position_ids is None:
                raise NotImplementedError(
                    "Under hf_longctx SP a sequence-classification model runs only inside RewardTrainer (input_ids "
                    "and position_ids from the SP data loader, no labels)."
                )
            owner = ref()
            out = getattr(owner, owner.base_model_prefix)(
                input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
            )
            logits = owner.score(out.last_hidden_state)
            scores = last_token_scores(logits, input_ids, attention_mask, position_ids, pad_token_id, groups)
            return SequenceClassifierOutputWithPast(logits=scores)

        return forward

    return make


def _compute_loss(trainer: Any):
    def make(original):
        def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            # TRL's loss, with metrics gathered as full per-row values (TRL's gather_for_metrics of a per-rank
            # mean would be summed over the SP group).
            mode = "train" if trainer.model.training else "eval"
            margin = inputs.pop("margin", None)
            outputs = model(**inputs, use_cache=False)
            chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
            delta = chosen - rejected if margin is None else chosen - rejected - margin
            loss = -F.logsigmoid(delta).mean()
            if trainer.args.center_rewards_coefficient is not None:
                loss = loss + trainer.args.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
            acc = trainer.accelerator
            metrics = trainer._metrics[mode]
            if mode == "train":
                tokens = acc.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()  # partial sums
                trainer._total_train_tokens += tokens // trainer._tp_size
            metrics["num_tokens"] = [trainer._total_train_tokens]
            with torch.no_grad():
                rewards = acc.gather(outputs.logits)  # each DP rank's rows, once per SP rank: same statistics
                metrics["min_reward"].append(rewards.min().item())
                metrics["mean_reward"].append(rewards.mean().item())
                metrics["max_reward"].append(rewards.max().item())
                metrics["accuracy"].append(acc.gather((chosen > rejected).float().mean()[None]).mean().item())
                metrics["margin"].append(acc.gather((chosen - rejected).mean()[None]).mean().item())
            return (loss, outputs) if return_outputs else loss

        return compute_loss

    return make


def setup_reward(trainer: Any, state: Any) -> None:
    """Switch a RewardTrainer's model to SP last-token pooling and its loss to SP-safe metrics (undone by detach).

    Raises:
        UnsupportedSetup: the model is not a transformers sequence-classification model with a `score`
            head, it has no `pad_token_id`, or it pools its score other than at the last token.
    """
    model = trainer.model
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(getattr(model, "score", None), torch.nn.Module) or not hasattr(model, "base_model_prefix"):
        raise UnsupportedSetup(f"{type(model).__name__} has no `score` head over the backbone's hidden states")
    if model.config.get_text_config().pad_token_id is None:
        raise UnsupportedSetup("the model config has no pad_token_id, so its last real token is undefined")
    pooling = getattr(model, "pooling", None)
    if pooling not in (None, "eos", "last"):
        # Cohere-Compass scores the first token ("bos") or the mean over the row ("mean"); this path reads the last.
        raise UnsupportedSetup(f"it pools its score with pooling={pooling!r}, and only the last-token score is served")
    patches = [
        Patch(model, "forward", _pooled_forward(model, state.groups)),
        Patch(trainer, "compute_loss", _compute_loss(trainer)),
    ]
    for patch in patches:
        patch.apply()
        state.undo.append(patch.remove)
    state.replicated_outputs = True  # every SP rank holds the whole scores and loss

"""The losses of token-classification and extractive-QA heads under SP, taken over the whole row.

`SequenceOps` installs one of these on an SP model whose head needs it (`heads.py`). At the forward's start
(`begin`) it takes the head's targets out of the call, so the model computes no loss from its shard alone; at
its end (`finish`) it returns the model's output with the loss a run without SP computes:

- **Token classification** (`*ForTokenClassification`): transformers' heads take the mean cross-entropy over the
  labelled tokens the forward is given (`ForTokenClassification` ignores `num_items_in_batch`), and the stock
  Trainer multiplies every process's loss by the number of processes. On plain DDP over W processes that is
  W x the mean of each rank's own token mean (upstream: W x the one-process loss when the ranks hold equally many
  labels). Each SP rank here divides its summed token loss by its SP group's labelled-token count / P: the count
  each of P data-parallel ranks divides by when the group's rows are spread evenly, so SP on W processes gives what
  plain DDP on the same W processes gives, and its gradient is the rank's exact share.
- **Extractive QA** (`*ForQuestionAnswering`): `ForQuestionAnsweringLoss` is a cross-entropy over the row's token
  positions, answers at or past the row's end ignored. Here the softmax's normaliser is the logsumexp over every
  rank's positions (SP padding excluded), the answer's logit is fetched from the rank that holds it, and the loss
  is whole on every SP rank with a P x share gradient (as `distributed.comm.group_sum`), which the data-parallel
  engine's average over all ranks turns into the single-device gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.distributed.comm import all_gather_stacked, all_reduce_sum, group_sum
from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.sequence.view import ShardView


class _GroupLogSumExp(torch.autograd.Function):
    """Forward: the logsumexp over the SP group of each rank's per-row logsumexp `[bs]`. Backward: this rank's
    softmax weight `exp(lse_local - lse_global)` times the incoming gradient times `grad_scale` (every rank uses
    the same global value, so no collective is needed in backward; see `group_sum`)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: Any, grad_scale: float) -> torch.Tensor:
        whole = torch.logsumexp(all_gather_stacked(local.detach().contiguous(), group), dim=0)
        weight = torch.exp(local.detach() - whole)  # 0 where this rank holds no position of the row
        ctx.save_for_backward(weight)
        ctx.grad_scale = grad_scale
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return grad * weight * ctx.grad_scale, None, None


LossTerm = Callable[[torch.Tensor], torch.Tensor]
"""What an adapter adds to the loss a model returns (AdaLoRA's regulariser: `adapter_terms.py`)."""


def _plus(loss: torch.Tensor, term: LossTerm | None) -> torch.Tensor:
    return loss if term is None else term(loss)


def _with_loss(output: Any, loss: torch.Tensor) -> Any:
    """`output` with `loss` first, as the model returns it when it computes one (a ModelOutput or a tuple)."""
    if isinstance(output, tuple):
        return (loss, *output)
    fields = {key: value for key, value in output.items() if key != "loss"}
    try:
        return type(output)(loss=loss, **fields)
    except TypeError:  # a ModelOutput without a `loss` field: keep the object, add the key
        output["loss"] = loss
        return output


class TokenClassificationLoss:
    """Per-token labels, each SP rank's summed cross-entropy over its group's labelled-token count / P."""

    def __init__(self, groups: SequenceParallelGroups, term: LossTerm | None = None) -> None:
        self.groups, self.term = groups, term
        self.labels: torch.Tensor | None = None

    def begin(self, kwargs: dict[str, Any], view: ShardView) -> None:
        self.labels = kwargs.pop("labels", None)

    def finish(self, output: Any) -> Any:
        labels, self.labels = self.labels, None
        if labels is None or output is None:
            return None
        logits = output["logits"] if not isinstance(output, tuple) else output[0]
        labels = labels.to(logits.device)
        summed = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        count = all_reduce_sum((labels != IGNORE_INDEX).sum().to(torch.float64), self.groups.sp_group)
        # A group without any label gives 0 with zero gradients (transformers' mean would be NaN).
        per_rank = count.clamp(min=1) / self.groups.sp_world_size
        return _with_loss(output, _plus(summed / per_rank.to(summed.device), self.term))


class QuestionAnsweringLoss:
    """Start / end cross-entropy over the whole row's positions, whole on every SP rank."""

    def __init__(self, groups: SequenceParallelGroups, term: LossTerm | None = None) -> None:
        self.groups, self.term = groups, term
        self.targets: tuple[torch.Tensor, torch.Tensor] | None = None
        self.view: ShardView | None = None
        self.num_items: Any = None

    def begin(self, kwargs: dict[str, Any], view: ShardView) -> None:
        start, end = kwargs.pop("start_positions", None), kwargs.pop("end_positions", None)
        self.targets = None if start is None or end is None else (start, end)
        self.view, self.num_items = view, kwargs.get("num_items_in_batch")

    def finish(self, output: Any) -> Any:
        targets, view, self.targets, self.view = self.targets, self.view, None, None
        if targets is None or output is None:
            return None
        if isinstance(output, tuple):
            start_logits, end_logits = output[0], output[1]
        else:
            start_logits, end_logits = output["start_logits"], output["end_logits"]
        start = self._cross_entropy(start_logits, targets[0], view)
        end = self._cross_entropy(end_logits, targets[1], view)
        return _with_loss(output, _plus((start + end) / 2, self.term))

    def _cross_entropy(self, logits: torch.Tensor, positions: torch.Tensor, view: ShardView) -> torch.Tensor:
        """`fixed_cross_entropy` of `[bs, sl_l]` position logits against global `positions` `[bs]`."""
        groups, scale = self.groups, float(self.groups.sp_world_size)
        index = view.local_index.to(logits.device)
        # transformers clamps the answers to [0, row length] and ignores those at the row's length.
        length = view.length
        positions = positions.reshape(positions.shape[0], -1)[:, 0].to(logits.device).clamp(0, length)
        # SP padding takes no probability. A finite fill: a rank holding only padding then has a finite local
        # logsumexp with weight 0 in the whole row's, where -inf would make logsumexp's backward NaN.
        logits = logits.float().masked_fill(~view.real_tokens().to(logits.device), torch.finfo(torch.float32).min)
        whole = _GroupLogSumExp.apply(torch.logsumexp(logits, dim=1), groups.sp_group, scale)
        valid = positions != length
        # [bs, sl_l]: the answer's token, True on the rank that holds it only.
        held = (index.unsqueeze(0) == positions.unsqueeze(1)) & valid.unsqueeze(1)
        picked = group_sum(torch.where(held, logits, 0.0).sum(dim=1), groups.sp_group, scale)
        summed = torch.where(valid, whole - picked, 0.0).sum()
        if self.num_items is not None:
            return summed / torch.as_tensor(self.num_items, device=summed.device)
        return summed / valid.sum()  # no answer in the batch: NaN, as transformers' mean

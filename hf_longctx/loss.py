"""Token-weighted loss across the ranks of a sequence-parallel group.

`sequence_parallel_loss` is the main function. Each rank holds the logits of its slice of the
sequence; the loss is the sum of every token loss in the group divided by one exact integer count,
so an SP run reports and back-propagates the same number as a single-device run on the same batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.distributed.comm import all_reduce_sum, group_sum
from hf_longctx.distributed.groups import SequenceParallelGroups


def count_valid_tokens(shift_labels: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Number of labels different from `IGNORE_INDEX`, summed over `group` as an int64 tensor."""
    return all_reduce_sum((shift_labels != IGNORE_INDEX).sum(dtype=torch.int64), group)


def sequence_parallel_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    groups: SequenceParallelGroups,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy summed over the SP group and divided by a token count, for a custom training loop.

    Two contracts, both exact after the usual gradient average over all ranks (what DDP, FSDP and ZeRO
    do, with every rank, SP ranks included, a data-parallel rank of the engine):

    - `num_items_in_batch=None`: the denominator is the SP group's valid-token count, so each DP
      group computes the mean over its own batch and the averaged gradient is the mean of those
      per-batch gradients (plain DDP semantics).
    - `num_items_in_batch=N`: `N` is the valid-token count of everything whose gradients are averaged
      together: all DP ranks' batches (and every micro-batch of a gradient-accumulation window). The
      averaged gradient is then the gradient of (sum of every token loss) / N, the single-device
      global token mean (Trainer semantics). The returned value is this SP group's part of it: sum it
      over `groups.dp_group` (and the window) to log the global loss.

    Args:
        logits: `[bs, sl_l, vocab]` logits of this rank's shard.
        shift_labels: `[bs, sl_l]` pre-shifted labels of the shard (`IGNORE_INDEX` = no loss).
        groups: the SP/DP groups; the sum runs over `groups.sp_group`.
        num_items_in_batch: None, or the global valid-token count described above.

    Returns:
        A scalar, identical on every rank of the SP group: the group's summed token loss divided by
        the denominator. A shard without any valid label contributes 0, never NaN, and still
        back-propagates.

    Raises:
        ValueError: `logits` and `shift_labels` disagree on `[bs, sl_l]`.
    """
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} disagree on [batch, seq]."
        )
    labels = shift_labels.to(logits.device)
    local_sum = F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    if num_items_in_batch is None:
        denom = count_valid_tokens(labels, groups.sp_group)
        # The engine averages over sp x dp ranks; each DP group's mean must count once per DP group.
        grad_scale = groups.sp_world_size
    else:
        denom = torch.as_tensor(num_items_in_batch, device=logits.device)
        # N already spans every DP rank: undo the engine's whole average over sp x dp ranks.
        grad_scale = groups.sp_world_size * groups.dp_world_size
    total = group_sum(local_sum, groups.sp_group, grad_scale)
    # A batch without any valid label: 0 with a connected graph, never 0 / 0.
    return total / denom.clamp(min=1).to(total.dtype)

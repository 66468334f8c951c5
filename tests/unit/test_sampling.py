"""transformers' `BatchRebalanceSampler` under SP, without a process group: the Trainer builds it with every process
as a data-parallel rank; `_compat.rebalance_for_data_parallel` makes it count the DP ranks only, so the SP ranks of
a group read the same micro-batches and the groups split each step as the ranks of a run without SP do."""

from __future__ import annotations

import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler

from hf_longctx import _compat

LENGTHS = torch.randint(5, 400, (37,), generator=torch.Generator().manual_seed(0)).tolist()


def _sampler(dp_size: int, rank: int, batch: int = 2, ga: int = 2) -> BatchRebalanceSampler:
    # What Trainer._get_train_sampler builds: effective batch = per-device batch x accumulation x DP ranks.
    return BatchRebalanceSampler(LENGTHS, batch * ga * dp_size, dp_size=dp_size, grad_accum=ga, rank=rank)


def test_dp2_sp2_reads_what_dp2_without_sp_reads():
    sp, dp = 2, 2
    for rank in range(sp * dp):
        sampler = _sampler(sp * dp, rank)  # as built on world 4
        assert _compat.rebalance_for_data_parallel(sampler, dp, rank // sp)
        assert list(sampler) == list(_sampler(dp, rank // sp)), rank
    assert list(_sampler(dp, 0)) != list(_sampler(dp, 1))


def test_already_data_parallel_or_another_sampler_is_left_alone():
    sampler = _sampler(2, 1)
    before = list(sampler)
    assert _compat.rebalance_for_data_parallel(sampler, 2, 1) and list(sampler) == before
    assert not _compat.rebalance_for_data_parallel(torch.utils.data.BatchSampler(range(4), 2, False), 1, 0)
    assert not _compat.rebalance_for_data_parallel(None, 1, 0)

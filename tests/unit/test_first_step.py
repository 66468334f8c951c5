"""The first-step checks without a process group: a rank's share of the sequence, arguments asking for SP that
the Trainer's accelerator did not take, and all-to-all groups across hosts (the collective parts run in
tests/dist/test_trainer.py and tests/dist/test_host_warning.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hf_longctx
from hf_longctx.attention.backends import resolve_backend
from hf_longctx.data.consistency import SIGNATURE_KEY, batch_signature
from hf_longctx.data.layout import pad_multiple
from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.distributed.groups import all_to_all_across_hosts
from hf_longctx.integrations.trainer import first_step as F


@pytest.mark.parametrize(("layout", "sp"), [("contiguous", 2), ("contiguous", 4), ("zigzag", 2), ("zigzag", 3)])
def test_each_rank_holds_its_share_of_an_odd_length_row(layout, sp):
    ids = torch.arange(1, 2 * 37 + 1).reshape(2, 37)
    batch = {"input_ids": ids, "labels": ids.clone()}
    for rank in range(sp):
        shard = shard_batch_for_rank(batch, rank, sp, layout=layout)
        shard[SIGNATURE_KEY] = batch_signature(batch)
        code, local, full, want, rows = F._share(shard, sp, layout)
        assert (code, full, rows) == (F.OK, 37, 2)
        assert local == want and 37 <= local * sp < 37 + pad_multiple(layout, sp)  # padded to the layout's multiple


def test_a_batch_sharded_otherwise_or_not_at_all_is_named():
    ids = torch.arange(40).reshape(1, 40)
    shard = shard_batch_for_rank({"input_ids": ids}, 0, 2)
    shard[SIGNATURE_KEY] = batch_signature({"input_ids": ids})
    assert F._share(shard, 4, "contiguous")[:2] == (F.WRONG_SHARE, 20)  # sharded for SP=2, run at SP=4
    assert F._share({"input_ids": ids}, 2, "contiguous")[0] == F.NOT_SHARDED  # the whole row, no signature


def test_arguments_asking_for_sp_without_an_attached_accelerator_are_refused():
    trainer = SimpleNamespace(args=SimpleNamespace(parallelism_config=hf_longctx.ParallelismConfig(sp_size=2)))
    trainer.accelerator = SimpleNamespace()  # no hf_longctx state on it
    with pytest.raises(ValueError, match=r"sp_size=2\) but the Trainer's accelerator runs sp_size=1"):
        F.check_config_applied(trainer)
    for config in (
        None,
        hf_longctx.ParallelismConfig(sp_size=1),
        hf_longctx.ParallelismConfig(sp_size=2, sp_backend="deepspeed"),
    ):
        F.check_config_applied(SimpleNamespace(args=SimpleNamespace(parallelism_config=config), accelerator=None))


@pytest.mark.parametrize(
    ("hosts", "sp", "degree", "spanning"),
    [
        ([0, 0, 1, 1], 4, 4, [[0, 1, 2, 3]]),  # Ulysses over 2 hosts
        ([0, 0, 1, 1], 4, 2, []),  # hybrid: Ulysses inside each host, the ring across them
        ([0, 1, 0, 1], 4, 2, [[0, 1], [2, 3]]),  # hybrid with hosts interleaved: every Ulysses pair spans 2
        ([0, 0, 1, 1], 2, 2, []),  # DP 2 x SP 2, one SP group per host
        ([0, 0, 1, 1], 4, 1, []),  # ring: no all-to-all
        ([7, 7, 7, 7], 4, 4, []),  # one host
    ],
)
def test_all_to_all_groups_across_hosts(hosts, sp, degree, spanning):
    assert all_to_all_across_hosts(hosts, sp, degree) == spanning


def test_the_across_hosts_warning_names_the_ranks_and_the_backends_that_keep_it_inside_a_host():
    hosts = [0] * 8 + [1] * 8
    message = F._across_hosts([list(range(16))], hosts, resolve_backend("ulysses", 16, 8, 16), ranks_per_node=8)
    assert message.startswith("the all-to-all of the Ulysses SP group spans hosts: ranks 0-15 on 2 hosts")
    assert 'sp_backend="auto"' in message and "ulysses_degree that divides 8" in message
    assert "LOCAL_WORLD_SIZE" not in message
    hybrid = resolve_backend("hybrid", 16, 8, 16, ulysses_degree=4)
    message = F._across_hosts([[0, 1, 2, 3], [8, 9, 10, 11]], [0, 1] * 8, hybrid, ranks_per_node=None)
    assert "hybrid backend's Ulysses group (ulysses_degree=4)" in message and "(2 such groups)" in message
    assert "LOCAL_WORLD_SIZE" in message

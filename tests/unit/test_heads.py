"""Ulysses head exchange (`head_layout`, `ulysses_attention`) for MHA, GQA, MQA and irregular splits.

The exchange is emulated in one process: first on head indices (what rank r receives), then
end to end with one thread per rank and an in-memory all-to-all, checked against an independent
full-sequence document-causal attention.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import LlamaAttention, eager_attention_forward

from hf_longctx import SequenceParallelGroups
from hf_longctx.attention import ulysses
from hf_longctx.attention.kernels import SequenceContext
from hf_longctx.attention.ulysses import HeadLayout, check_heads, head_layout, valid_sp_sizes

# (num_heads, num_kv_heads, sp_size)
COMBOS = [
    (4, 4, 1),
    (4, 2, 1),
    (4, 4, 2),  # MHA
    (8, 8, 4),
    (8, 4, 2),  # GQA, kv heads divisible by sp
    (8, 4, 4),
    (8, 2, 2),
    (8, 2, 4),  # kv heads < sp, sp % kv == 0
    (16, 4, 8),
    (12, 2, 4),
    (8, 1, 4),  # MQA
    (4, 1, 4),
    (4, 1, 2),
    (12, 6, 4),  # irregular
    (12, 4, 3),
    (6, 3, 2),
    (6, 2, 3),
    (12, 4, 6),
    (12, 3, 4),
]


def received_kv_heads(layout: HeadLayout, num_kv_heads: int, rank: int) -> list[int]:
    """The global kv head ids rank `rank` holds after the exchange (destination-major send order)."""
    order = list(layout.kv_index) if layout.kv_index is not None else list(range(num_kv_heads))
    assert len(order) % layout.kv_local == 0
    return order[rank * layout.kv_local : (rank + 1) * layout.kv_local]


@pytest.mark.parametrize(("heads", "kv_heads", "sp"), COMBOS)
def test_local_gqa_expansion_maps_each_query_head_to_its_kv_head(heads, kv_heads, sp):
    layout = head_layout(heads, kv_heads, sp)
    group = heads // kv_heads
    assert layout.q_local == heads // sp
    if layout.kv_index is not None:
        assert len(layout.kv_index) == sp * layout.kv_local
    for rank in range(sp):
        kv_here = torch.tensor(received_kv_heads(layout, kv_heads, rank))
        expanded = kv_here.repeat_interleave(layout.kv_groups_local)  # what repeat_kv does locally
        assert expanded.numel() == layout.q_local
        query_heads = range(rank * layout.q_local, (rank + 1) * layout.q_local)
        assert expanded.tolist() == [h // group for h in query_heads]


@pytest.mark.parametrize(("heads", "kv_heads", "sp"), COMBOS)
def test_layout_sends_no_more_kv_heads_than_needed(heads, kv_heads, sp):
    layout = head_layout(heads, kv_heads, sp)
    group = heads // kv_heads
    distinct_needed = len({h // group for h in range(heads // sp)})
    if kv_heads % sp == 0:
        assert layout.kv_index is None and layout.kv_local == kv_heads // sp
    elif group % layout.q_local == 0:
        assert layout.kv_local == distinct_needed == 1
    else:
        assert layout.kv_local == layout.q_local


def test_check_heads_lists_valid_sizes():
    with pytest.raises(ValueError, match=r"\[1, 2, 3, 6\]"):
        check_heads(6, 4)
    check_heads(6, 3)
    assert valid_sp_sizes(12) == [1, 2, 3, 4, 6, 12]


def test_head_layout_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"\[1, 2, 4, 8\]"):
        head_layout(8, 2, 3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        head_layout(8, 3, 2)


# ---------------------------------------------------------------------------------------------
# End-to-end emulation: one thread per rank, in-memory all-to-all
# ---------------------------------------------------------------------------------------------


class _FakeCollective:
    """All-to-all across threads with the semantics documented in `hf_longctx.distributed.comm.all_to_all`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.calls = 0

    def all_to_all(self, x, scatter_dim, gather_dim, group):
        rank = group.rank
        self.slots[rank] = x
        self.barrier.wait()
        received = [self.slots[src].chunk(self.world, dim=scatter_dim)[rank] for src in range(self.world)]
        out = torch.cat(received, dim=gather_dim)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        if rank == 0:
            self.calls += 1
        return out


@dataclasses.dataclass(frozen=True)
class _FakeGroup:
    rank: int


def _reference_attention(q, k, v, position_ids, scaling):
    """Independent full-sequence document-causal attention; q `[bs, H, S, d]` -> `[bs, S, H, d]`."""
    heads, kv_heads, sl = q.shape[1], k.shape[1], q.shape[2]
    kv_of = torch.arange(heads) // (heads // kv_heads)
    k, v = k[:, kv_of], v[:, kv_of]
    doc = (position_ids == 0).cumsum(dim=1)  # documents restart at 0
    idx = torch.arange(sl)
    allowed = (idx[:, None] >= idx[None, :]) & (doc[:, :, None] == doc[:, None, :])
    scores = (q @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def _run_ranks(world, fn, barrier):
    """Run `fn(rank)` on one thread per rank; re-raise the first real failure."""
    results, errors = [None] * world, []

    def target(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()  # unblock the ranks waiting in the fake collective

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "emulated ranks hung"
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results


EMULATED = [
    (4, 4, 2),
    (8, 2, 4),
    (8, 1, 4),
    (4, 1, 2),
    (12, 6, 4),
    (12, 4, 3),
    (6, 3, 2),
    (12, 2, 4),
]


@pytest.mark.parametrize("kernel_name", ["sdpa", "eager"])
@pytest.mark.parametrize(("heads", "kv_heads", "sp"), EMULATED)
def test_ulysses_attention_emulated_matches_full_attention(heads, kv_heads, sp, kernel_name, monkeypatch):
    head_dim, bs, sl = 8, 2, 6 * sp
    config = LlamaConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        attn_implementation=kernel_name,
    )
    module = LlamaAttention(config, layer_idx=0).eval()
    kernel = sdpa_attention_forward if kernel_name == "sdpa" else eager_attention_forward

    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + sp)
    q = torch.randn(bs, heads, sl, head_dim, generator=gen)
    k = torch.randn(bs, kv_heads, sl, head_dim, generator=gen)
    v = torch.randn(bs, kv_heads, sl, head_dim, generator=gen)
    # Row 0: three packed documents whose boundaries do not align with shards; row 1: one document.
    cuts = [0, sl // 3 + 1, sl - 2]
    row0 = [i - max(c for c in cuts if c <= i) for i in range(sl)]
    position_ids = torch.tensor([row0, list(range(sl))])
    expected = _reference_attention(q, k, v, position_ids, module.scaling)

    collective = _FakeCollective(sp)
    monkeypatch.setattr(ulysses, "all_to_all", collective.all_to_all)
    base = SequenceParallelGroups.single()
    local = sl // sp

    def rank_fn(rank):
        groups = dataclasses.replace(base, sp_group=_FakeGroup(rank), sp_rank=rank, sp_world_size=sp)
        part = slice(rank * local, (rank + 1) * local)
        out, weights = ulysses.ulysses_attention(
            module,
            q[:, :, part],
            k[:, :, part],
            v[:, :, part],
            kernel=kernel,
            kernel_name=kernel_name,
            family=kernel_name,
            context=SequenceContext(position_ids),
            groups=groups,
            scaling=module.scaling,
            dropout=0.0,
        )
        assert weights is None
        return out

    outs = _run_ranks(sp, rank_fn, collective.barrier)
    assert collective.calls == 2  # one exchange for q/k/v together, one for the output
    for rank, out in enumerate(outs):
        assert out.shape == (bs, local, heads, head_dim)
        torch.testing.assert_close(out, expected[:, rank * local : (rank + 1) * local], atol=1e-5, rtol=1e-5)
    # The module itself is never mutated by the kernel view.
    assert module.num_key_value_groups == heads // kv_heads
    assert module.config._attn_implementation == kernel_name


def test_ulysses_attention_rejects_shard_not_matching_global_positions():
    module = LlamaAttention(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2), 0)
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="shard_batch"):
        ulysses.ulysses_attention(
            module,
            q,
            k,
            v,
            kernel=sdpa_attention_forward,
            kernel_name="sdpa",
            family="sdpa",
            context=SequenceContext(torch.arange(5).unsqueeze(0)),
            groups=SequenceParallelGroups.single(),
        )

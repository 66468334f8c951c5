"""Backend resolution (`resolve_backend`, `choose_backend`), hybrid rank placement, ring options on the
config, and the communication-volume formulas; all pure, no process group."""

from __future__ import annotations

import pytest

from hf_longctx import ParallelismConfig
from hf_longctx.attention.auto import choose_backend
from hf_longctx.attention.backends import resolve_backend
from hf_longctx.attention.cost import hybrid_bytes, ring_bytes, ulysses_bytes
from hf_longctx.distributed.groups import hybrid_rank_grid
from hf_longctx.instrument import ulysses_min_bytes


@pytest.mark.parametrize(
    ("heads", "kv", "sp", "node", "expected"),
    [
        ((9, 3, 2, None, ("ring", 1))),  # SmolLM2-135M: 9 heads divide neither 2 nor 4
        ((9, 3, 4, 4, ("ring", 1))),
        ((4, 2, 4, 4, ("ulysses", 4))),  # heads divide sp and everything is on one node
        ((32, 8, 8, 8, ("ulysses", 8))),
        ((32, 8, 16, 8, ("hybrid", 8))),  # two nodes: Ulysses inside each, ring across
        ((32, 32, 64, 8, ("hybrid", 8))),
        ((6, 2, 4, 4, ("hybrid", 2))),
        ((12, 2, 8, 4, ("hybrid", 4))),  # Ulysses never leaves a 4-rank node
    ],
)
def test_auto_choice(heads, kv, sp, node, expected):
    choice = choose_backend(heads, kv, sp, node)
    assert (choice.backend, choice.ulysses_degree) == expected
    assert f"{heads} query / {kv} kv heads on sp={sp}" in choice.reason


def test_auto_keeps_every_ulysses_group_inside_a_node():
    for heads in (8, 16, 32, 64):
        for node in (2, 4, 8):
            choice = choose_backend(heads, heads // 2, 16, node)
            assert choice.ulysses_degree <= node and node % choice.ulysses_degree == 0


def test_auto_ring_variant_follows_the_gathered_kv_size():
    assert choose_backend(9, 3, 2).ring_variant == "allgather"  # 2 ranks x 3 kv heads <= 9 query heads
    assert choose_backend(9, 9, 2).ring_variant == "p2p"


def test_resolve_backend_explicit_and_errors():
    assert resolve_backend("ring", 9, 3, 4).layout == "zigzag"
    hybrid = resolve_backend("hybrid", 8, 2, 4, ulysses_degree=2, ring_layout="contiguous", ring_variant="allgather")
    assert (hybrid.name, hybrid.ulysses_degree, hybrid.ring_size, hybrid.layout) == ("hybrid", 2, 2, "contiguous")
    # A Ulysses degree equal to the SP size is plain Ulysses (the model's own kernel, contiguous layout).
    assert resolve_backend("hybrid", 8, 2, 4, ulysses_degree=4).name == "ulysses"
    with pytest.raises(ValueError, match=r"valid degrees: \[1, 2\]"):
        resolve_backend("hybrid", 6, 2, 4, ulysses_degree=4)
    with pytest.raises(ValueError, match=r"valid sp_size values for this model: \[1, 3, 9\]"):
        resolve_backend("ulysses", 9, 3, 2)
    with pytest.raises(ValueError, match='sp_backend="hybrid"'):
        resolve_backend("ring", 8, 2, 4, ulysses_degree=2)
    with pytest.raises(ValueError, match="ring_variant"):
        resolve_backend("ring", 8, 2, 4, ring_variant="alltoall")


def test_hybrid_rank_grid_places_ulysses_on_consecutive_ranks_within_nodes():
    ulysses, ring = hybrid_rank_grid(world_size=16, sp_size=8, ulysses_degree=4)
    assert ulysses[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]] and ulysses[2] == [8, 9, 10, 11]
    assert ring[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]] and ring[4] == [8, 12]
    ranks_per_node = 4
    for group in ulysses:
        assert len({r // ranks_per_node for r in group}) == 1  # an all-to-all never crosses nodes
    for group in ring:
        assert len({r // ranks_per_node for r in group}) == 2  # ring hops cross them
    assert sorted(r for g in ulysses for r in g) == sorted(r for g in ring for r in g) == list(range(16))
    with pytest.raises(ValueError, match=r"must divide sp_size=8"):
        hybrid_rank_grid(16, 8, 3)


def test_config_ring_options_are_validated():
    config = ParallelismConfig(sp_size=4, sp_backend="hybrid", ulysses_degree=2, ring_variant="allgather")
    assert config.attention_options() == {
        "backend": "hybrid",
        "ulysses_degree": 2,
        "ring_variant": "allgather",
        "ring_layout": "zigzag",
        "ulysses_head_chunks": 1,
    }
    with pytest.raises(ValueError, match="ulysses_degree applies to sp_backend='hybrid' or 'auto'"):
        ParallelismConfig(sp_size=4, sp_backend="ring", ulysses_degree=2)
    with pytest.raises(ValueError, match=r"must divide sp_size=4"):
        ParallelismConfig(sp_size=4, sp_backend="hybrid", ulysses_degree=3)
    with pytest.raises(ValueError, match="ring_layout"):
        ParallelismConfig(sp_size=4, sp_backend="ring", ring_layout="striped")


def test_byte_formulas():
    heads, kv, d, seq, sp, elem = 8, 2, 16, 1024, 4, 4
    # Ring forward per rank per layer: 2 S d_kv (P - 1) / P (issue 10's theory, d_kv = kv heads x d).
    ring = ring_bytes(kv, d, seq, sp, elem)
    assert ring.forward == 2 * seq * kv * d * (sp - 1) / sp * elem
    # Backward: K/V again plus fp32 dK/dV over P hops (p2p) or P - 1 blocks (reduce-scatter).
    assert ring.backward == ring.forward + sp * 2 * (seq / sp) * kv * d * 4
    assert ring_bytes(kv, d, seq, sp, elem, variant="allgather").backward == 2 * ring.forward
    assert ulysses_bytes(heads, 4, d, seq, sp, sp, elem).forward == ulysses_min_bytes(heads, 4, d, seq, sp, elem)
    # 2 kv heads on 4 ranks: each rank is sent the one kv head its query heads read (4 copies in all).
    assert ulysses_bytes(heads, kv, d, seq, sp, sp, elem).forward == ulysses_min_bytes(heads, 4, d, seq, sp, elem)
    both = hybrid_bytes(heads, kv, d, seq, sp, 2, elem)
    parts = ulysses_bytes(heads, kv, d, seq, 2, sp, elem) + ring_bytes(1, d, seq, 2, elem)
    assert both == parts

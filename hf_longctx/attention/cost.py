"""Communication volume of each SP backend: bytes one rank sends per attention layer.

The theory the instrumentation is checked against (tests, benchmarks) and the cost model behind
`sp_backend="auto"`. All functions are pure. Notation: S global tokens, P SP ranks, U Ulysses degree,
R = P / U ring degree, d / d_v head sizes, `elem` bytes per activation element, `acc` bytes per
element of the fp32 (fp64 for fp64 runs) dK/dV accumulators the ring backward moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_longctx.attention.ulysses import head_layout


@dataclass(frozen=True)
class Bytes:
    """Bytes one rank sends in one layer's forward and backward (activation checkpointing replays the
    forward once more)."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.backward

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.forward + other.forward, self.backward + other.backward)


def ulysses_bytes(
    heads: int, kv_heads: int, head_dim: int, seq_len: int, ulysses: int, sp: int, elem: int, v_head_dim: int = 0
) -> Bytes:
    """Ulysses all-to-alls over `ulysses` ranks on shards of S / sp tokens: q, k, v in (k, v only the
    heads each destination's query heads read, replicated when kv heads < U), output back; the
    backward mirrors it (dO in; dQ, dK, dV back)."""
    if ulysses == 1:
        return Bytes(0.0, 0.0)
    dv = v_head_dim or head_dim
    layout = head_layout(heads, kv_heads, ulysses)
    kv_sent = layout.kv_local * ulysses  # kv heads in the send buffer, replicas included
    per_token = heads * head_dim + kv_sent * (head_dim + dv) + heads * dv
    one_way = seq_len / sp * per_token * (ulysses - 1) / ulysses * elem
    return Bytes(one_way, one_way)


def ring_bytes(
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    ring: int,
    elem: int,
    acc: int = 4,
    variant: str = "p2p",
    v_head_dim: int = 0,
) -> Bytes:
    """Ring over `ring` ranks of S / ring tokens with `kv_heads` local kv heads.

    Forward: K+V of the local block reach the R - 1 other ranks (p2p hops or one all-gather). Backward:
    K+V again (re-sent, not stored) plus the dK/dV accumulators: p2p moves them R hops in fp32 (the
    last hop brings them home); all-gather reduce-scatters R - 1 blocks of them."""
    if ring == 1:
        return Bytes(0.0, 0.0)
    block = seq_len / ring * kv_heads * (head_dim + (v_head_dim or head_dim))
    kv = (ring - 1) * block * elem
    grads = (ring if variant == "p2p" else ring - 1) * block * acc
    return Bytes(kv, kv + grads)


def hybrid_bytes(
    heads: int,
    kv_heads: int,
    head_dim: int,
    seq_len: int,
    sp: int,
    ulysses: int,
    elem: int,
    acc: int = 4,
    variant: str = "p2p",
    v_head_dim: int = 0,
) -> Bytes:
    """Ulysses over U plus the ring over R = sp / U with the kv heads each device holds after the
    all-to-all (one per query head group; replicated kv heads count once per device)."""
    kv_local = head_layout(heads, kv_heads, ulysses).kv_local
    return ulysses_bytes(heads, kv_heads, head_dim, seq_len, ulysses, sp, elem, v_head_dim) + ring_bytes(
        kv_local, head_dim, seq_len, sp // ulysses, elem, acc, variant, v_head_dim
    )

"""`sp_backend="auto"`: pick Ulysses, ring or hybrid, and the Ulysses degree, from the model and the job.

`choose_backend` is the main (pure) function. Rule:

1. Candidate Ulysses degrees U: divisors of the SP size P that divide the query heads (Ulysses
   splits heads) and, when the ranks per node G are known, divide G and are at most G (an
   all-to-all never leaves a node: Ulysses groups are consecutive ranks).
2. For each, estimate the communication time of one layer's forward and backward per rank: the Ulysses bytes
   (`cost.py`) over the intra-node link plus the ring bytes over the link the ring crosses (the
   inter-node one when the SP group spans nodes). Nominal bandwidths per GPU: NVLink 450 GB/s, PCIe
   32 GB/s, inter-node 50 GB/s (400 Gb/s InfiniBand); an unknown intra-node link counts as NVLink
   and CPU processes on one host as one link (bytes alone decide).
3. Take the cheapest, the larger U on ties (fewer ring steps: less latency, fewer kernel calls).
   U = P is "ulysses", U = 1 "ring", else "hybrid". The ring variant is "allgather" when the
   gathered K/V of the ring is no larger than the local queries (R * kv heads per device <= query
   heads per device: GQA), else "p2p" (O(S / R) memory, transfers hidden behind compute).

The estimate leaves out overlap: ring hops run while the previous block computes, so the choice
errs towards Ulysses, which is exact on every kernel the model has (flash, flex, sinks, soft-capping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_longctx.attention.cost import ring_bytes, ulysses_bytes
from hf_longctx.attention.ulysses import head_layout

# Nominal one-direction bandwidth per GPU in GB/s (public figures: NVLink 4 on H100 900 GB/s both
# directions; PCIe 5.0 x16 ~64 GB/s both; NDR InfiniBand 400 Gb/s per GPU).
LINK_GBPS = {"nvlink": 450.0, "pcie": 32.0, "inter_node": 50.0, "host": 1.0}
LINKS = ("nvlink", "pcie", "host")


@dataclass(frozen=True)
class AutoChoice:
    """The chosen backend, Ulysses degree and ring variant, and why (logged at enable time)."""

    backend: str
    ulysses_degree: int
    ring_variant: str
    reason: str


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_backend(
    num_heads: int,
    num_kv_heads: int,
    sp_size: int,
    ranks_per_node: int | None = None,
    link: str | None = None,
) -> AutoChoice:
    """Choose the SP backend for a model with `num_heads` / `num_kv_heads` heads on `sp_size` ranks.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads.
        sp_size: P.
        ranks_per_node: G, ranks per node (None: unknown, the SP group is taken to be inside one node).
        link: intra-node link: "nvlink", "pcie", "host" (CPU processes) or None (unknown).

    Returns:
        The choice; `reason` states the inputs and the estimate per candidate.

    Raises:
        ValueError: an unknown link or non-positive sizes.
    """
    if link is not None and link not in LINKS:
        raise ValueError(f"Unknown link {link!r}; choose one of {list(LINKS)} or None.")
    if min(num_heads, num_kv_heads, sp_size) < 1:
        raise ValueError("num_heads, num_kv_heads and sp_size must be >= 1.")
    node = ranks_per_node if ranks_per_node and ranks_per_node >= 1 else sp_size
    candidates = [u for u in _divisors(sp_size) if num_heads % u == 0 and u <= node and node % u == 0]
    intra = LINK_GBPS[link or "nvlink"]
    ring_link = intra if sp_size <= node or link == "host" else LINK_GBPS["inter_node"]
    # One layer, one token per rank, head size 1, 2-byte elements: only the ratios matter.
    cost = {}
    for u in candidates:
        kv_local = head_layout(num_heads, num_kv_heads, u).kv_local
        a2a = ulysses_bytes(num_heads, num_kv_heads, 1, sp_size, u, sp_size, 2).total
        ring = ring_bytes(kv_local, 1, sp_size, sp_size // u, 2).total
        cost[u] = a2a / intra + ring / ring_link
    best = min(candidates, key=lambda u: (cost[u], -u))
    ring = sp_size // best
    backend = "ulysses" if best == sp_size else ("ring" if best == 1 else "hybrid")
    kv_local = head_layout(num_heads, num_kv_heads, best).kv_local
    variant = "allgather" if ring > 1 and ring * kv_local <= num_heads // best else "p2p"
    estimates = ", ".join(f"U={u}: {cost[u]:.3g}" for u in candidates)
    reason = (
        f"{backend} (Ulysses degree {best} x ring {ring}, ring variant {variant}) for {num_heads} query / "
        f"{num_kv_heads} kv heads on sp={sp_size}, {ranks_per_node or 'unknown'} ranks per node, link "
        f"{link or 'unknown'}; Ulysses degrees must divide the heads and stay inside a node: {candidates}; "
        f"estimated communication time per layer, forward + backward (relative): {estimates}"
    )
    return AutoChoice(backend, best, variant, reason)


def detect_link(device: torch.device) -> str | None:
    """The intra-node link of `device` where it can be known: "host" for CPU processes, "nvlink" or
    "pcie" for CUDA when NVML (`pynvml`) reports the NVLink state, else None (unknown)."""
    if device.type == "cpu":
        return "host"
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        enabled = pynvml.nvmlDeviceGetNvLinkState(handle, 0) == pynvml.NVML_FEATURE_ENABLED
    except pynvml.NVMLError_NotSupported:  # a GPU without NVLink
        return "pcie"
    except pynvml.NVMLError:
        return None
    return "nvlink" if enabled else "pcie"

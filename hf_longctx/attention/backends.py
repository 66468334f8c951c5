"""Resolve a requested SP backend into what runs: Ulysses or Ulysses x ring, and the token layout.

`resolve_backend` is the main (pure) function, called by `enable_sequence_parallel` and by
`hf-longctx check` before anything is launched: every invalid combination raises a `ValueError`
naming the fix. "ring" is the hybrid with Ulysses degree 1; "hybrid" without a degree and "auto"
take theirs from `auto.choose_backend`; a Ulysses degree equal to the SP size is plain Ulysses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch.distributed as dist

from hf_longctx.attention.auto import choose_backend
from hf_longctx.attention.ring.attention import check_variant
from hf_longctx.attention.ulysses import check_heads
from hf_longctx.data.layout import check_layout
from hf_longctx.distributed.comm import all_gather_object

BACKENDS = ("ulysses", "ring", "hybrid", "auto")


@dataclass(frozen=True)
class SPBackend:
    """What runs: `name` is "ulysses", "ring" or "hybrid" (auto resolved), with the Ulysses degree,
    the ring variant and the token layout the data side must produce."""

    name: str
    sp_size: int
    ulysses_degree: int
    ring_variant: str
    layout: str
    reason: str = ""

    @property
    def ring_size(self) -> int:
        """Ranks in each ring (1 for Ulysses)."""
        return self.sp_size // self.ulysses_degree


def valid_ulysses_degrees(num_heads: int, sp_size: int) -> list[int]:
    """Ulysses degrees usable for `num_heads` query heads at SP size `sp_size`."""
    return [u for u in range(1, sp_size + 1) if sp_size % u == 0 and num_heads % u == 0]


def resolve_backend(
    backend: str,
    num_heads: int,
    num_kv_heads: int,
    sp_size: int,
    *,
    ulysses_degree: int | None = None,
    ring_variant: str | None = None,
    ring_layout: str = "zigzag",
    ranks_per_node: int | None = None,
    link: str | None = None,
) -> SPBackend:
    """The backend that will run for this model and SP size.

    Args:
        backend: "ulysses", "ring", "hybrid" or "auto".
        num_heads, num_kv_heads: the model's query and key/value heads.
        sp_size: P.
        ulysses_degree: hybrid/auto: the Ulysses degree U (P / U ranks per ring); None = chosen.
        ring_variant: "p2p" (pass-KV) or "allgather"; None = "p2p", or auto's choice.
        ring_layout: "zigzag" (balanced causal work) or "contiguous", for backends with a ring.
        ranks_per_node, link: inputs of the automatic choice (see `auto.choose_backend`).

    Raises:
        ValueError: unknown names, a Ulysses degree that does not divide P or the heads, Ulysses with
            heads not divisible by P, or options that do not apply to the backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Unknown sequence-parallel backend {backend!r}; choose one of {list(BACKENDS)}.")
    check_layout(ring_layout)
    if ring_variant is not None:
        check_variant(ring_variant)
    if backend == "ulysses":
        check_heads(num_heads, sp_size)
        if ulysses_degree not in (None, sp_size):
            raise ValueError(
                f'ulysses_degree={ulysses_degree} applies to sp_backend="hybrid" or "auto"; Ulysses uses all '
                f'{sp_size} ranks. Set sp_backend="hybrid" or drop ulysses_degree.'
            )
        return SPBackend("ulysses", sp_size, sp_size, ring_variant or "p2p", "contiguous")
    if backend == "ring" and ulysses_degree not in (None, 1):
        raise ValueError(
            f'ulysses_degree={ulysses_degree} does not apply to sp_backend="ring" (a ring over all {sp_size} ranks); '
            'use sp_backend="hybrid" for Ulysses x ring.'
        )
    choice = choose_backend(num_heads, num_kv_heads, sp_size, ranks_per_node, link)
    if backend == "ring":
        degree, reason = 1, ""
    elif ulysses_degree is not None:
        valid = valid_ulysses_degrees(num_heads, sp_size)
        if ulysses_degree not in valid:
            raise ValueError(
                f"ulysses_degree={ulysses_degree} must divide sp_size={sp_size} and num_attention_heads="
                f"{num_heads}; valid degrees: {valid} (the ring takes sp_size / ulysses_degree ranks)."
            )
        degree, reason = ulysses_degree, f"Ulysses degree {ulysses_degree} as configured"
    else:
        degree, reason = choice.ulysses_degree, choice.reason
    variant = ring_variant or (choice.ring_variant if backend == "auto" else "p2p")
    if degree == sp_size:  # a ring of one rank: plain Ulysses, with the model's own kernel
        return SPBackend("ulysses", sp_size, sp_size, variant, "contiguous", reason)
    return SPBackend("ring" if degree == 1 else "hybrid", sp_size, degree, variant, ring_layout, reason)


def decided_locally(backend: str, ulysses_degree: int | None) -> bool:
    """True when the resolution reads this rank's own view of the job (ranks per node, NVML link)."""
    return backend == "auto" or (backend == "hybrid" and ulysses_degree is None)


def agree_across_ranks(sp: SPBackend, group: dist.ProcessGroup | None, inputs: dict[str, Any]) -> None:
    """Refuse, on every rank of `group`, a backend that the ranks resolved differently.

    "auto" decides on each rank from what that rank sees (LOCAL_WORLD_SIZE, the NVML link); ranks that
    disagree would build different process groups or run different collectives and hang. One
    `all_gather_object` of each rank's choice and `inputs` (what it decided from) settles it.

    Raises:
        ValueError: naming every rank, its choice and its inputs, and the setting that fixes it.
    """
    choice = {k: v for k, v in asdict(sp).items() if k != "reason"}
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = all_gather_object({"rank": rank, "choice": choice, "inputs": inputs}, group)
    if all(row["choice"] == rows[0]["choice"] for row in rows):
        return
    per_rank = "; ".join(
        f"rank {row['rank']}: {row['choice']['name']} (Ulysses degree {row['choice']['ulysses_degree']}, ring variant "
        f"{row['choice']['ring_variant']}, {row['choice']['layout']} layout) from {row['inputs']}"
        for row in rows
    )
    raise ValueError(
        f"The sequence-parallel ranks resolved the backend differently ({per_rank}). Each rank decides from its own "
        "ranks per node (LOCAL_WORLD_SIZE) and NVML link, and ranks running different backends would hang. Launch "
        "every node with the same number of processes, or set the backend explicitly on ParallelismConfig / "
        'enable_sequence_parallel (sp_backend="ulysses", "ring", or "hybrid" with ulysses_degree=N).'
    )

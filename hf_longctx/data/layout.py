"""Which global token positions each sequence-parallel rank holds: the token layout.

Two layouts exist. `"contiguous"` (Ulysses): rank p holds positions `[p * S/P, (p + 1) * S/P)`.
`"zigzag"` (ring and hybrid): the sequence is cut into 2P equal chunks and rank p holds chunks p and
2P-1-p, so every rank does the same causal attention work at every ring step (a rank with early
tokens also holds late ones). `layout_indices` is the main function. Which layout is in force on a
`SequenceParallelGroups` is its `LayoutSlot` (`distributed/layout_slot.py`), which `shard_batch` and the
Trainer collator read so that the data side always agrees with the attention.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from hf_longctx.distributed.layout_slot import LAYOUTS, check_layout

# Every shard `shard_batch` and the Trainer collator build names its layout under this key; the model
# pre-hook pops it and refuses a mismatch either way (plausible loss, wrong gradients). A batch without
# the key (a custom loop's slices) is what slicing gives: contiguous.
LAYOUT_KEY = "hf_longctx_token_layout"


_CODES = (None, *LAYOUTS)


def layout_code(kind: str | None) -> int:
    """`kind` as a small int for the cross-rank all-gather: 0 for a shard that names no layout."""
    return _CODES.index(kind) if kind in _CODES else -1


def check_shard_layouts(codes: list[int], expected: str, attention: str) -> None:
    """Raise (on every rank: `codes` holds every SP rank's `layout_code`) unless every shard is in `expected`.

    A shard that names no layout counts as contiguous: that is what slicing a batch in a custom loop gives.

    Raises:
        ValueError: naming the SP ranks, the layout their shards are in and the setting that fixes it.
    """
    found = {r: (_CODES[c] or "contiguous") if 0 <= c < len(_CODES) else "unknown" for r, c in enumerate(codes)}
    wrong = {r: kind for r, kind in found.items() if kind != expected}
    if not wrong:
        return
    untagged = [r for r in wrong if codes[r] == 0]
    note = f" (SP ranks {untagged}: no {LAYOUT_KEY!r} key, so taken as contiguous slices)" if untagged else ""
    if expected == "zigzag":
        fix = (
            "Build the shards with hf_longctx.shard_batch(batch, groups) (or the Trainer integration) after "
            "enable_sequence_parallel, which shard in the zigzag layout, or run the ring on contiguous shards: "
            'ParallelismConfig(ring_layout="contiguous") / enable_sequence_parallel(..., ring_layout="contiguous").'
        )
    else:
        fix = (
            "Shard with hf_longctx.shard_batch(batch, groups) after enabling SP on this model, with the same groups "
            '(it follows the model\'s layout), or, for ring/hybrid attention on zigzag shards, ring_layout="zigzag" '
            "on ParallelismConfig / enable_sequence_parallel."
        )
    raise ValueError(
        f"The batch was sharded in the wrong token layout: {attention} attention expects {expected!r} but SP rank "
        f"shards are {found}{note}. Tokens at the wrong positions give a plausible loss and wrong gradients. {fix}"
    )


def pad_multiple(kind: str, sp_world_size: int) -> int:
    """The sequence length must be a multiple of this: P (contiguous) or 2P (zigzag, 2P chunks)."""
    check_layout(kind)
    return sp_world_size if kind == "contiguous" or sp_world_size == 1 else 2 * sp_world_size


@lru_cache(maxsize=256)
def _indices(kind: str, sp_rank: int, sp_world_size: int, seq_len: int) -> torch.Tensor:
    if seq_len % pad_multiple(kind, sp_world_size) != 0:
        raise ValueError(
            f"Sequence length {seq_len} is not a multiple of {pad_multiple(kind, sp_world_size)} "
            f"({kind} layout over {sp_world_size} ranks); build batches with hf_longctx.shard_batch."
        )
    if kind == "contiguous" or sp_world_size == 1:
        chunk = seq_len // sp_world_size
        return torch.arange(sp_rank * chunk, (sp_rank + 1) * chunk)
    chunk = seq_len // (2 * sp_world_size)
    first, second = sp_rank, 2 * sp_world_size - 1 - sp_rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


def layout_indices(kind: str, sp_rank: int, sp_world_size: int, seq_len: int) -> torch.Tensor:
    """Global positions `[seq_len / P]` (int64, increasing) of the tokens rank `sp_rank` holds.

    Raises:
        ValueError: unknown layout, or `seq_len` not a multiple of `pad_multiple(kind, P)`.
    """
    check_layout(kind)
    if not 0 <= sp_rank < sp_world_size:
        raise ValueError(f"sp_rank={sp_rank} is outside [0, {sp_world_size}).")
    return _indices(kind, sp_rank, sp_world_size, seq_len)


def gathered_order(kind: str, sp_world_size: int, seq_len: int) -> torch.Tensor:
    """Global positions of the concatenation of every rank's shard in rank order (what an all-gather
    of shards returns); `x_global[:, gathered_order] = x_gathered` restores the global order."""
    return torch.cat([layout_indices(kind, r, sp_world_size, seq_len) for r in range(sp_world_size)])


def to_global_order(gathered: torch.Tensor, kind: str, sp_world_size: int, dim: int = 1) -> torch.Tensor:
    """Reorder shards concatenated in rank order (along `dim`) into global sequence order."""
    if kind == "contiguous" or sp_world_size == 1:
        return gathered
    order = gathered_order(kind, sp_world_size, gathered.shape[dim]).to(gathered.device)
    return gathered.index_select(dim, torch.argsort(order))


def ring_indices(kind: str, sp_world_size: int, ulysses_degree: int, seq_len: int) -> list[torch.Tensor]:
    """Global positions each ring rank holds, sorted: ring rank j of a Ulysses x ring layout holds the
    tokens of SP ranks `j * U .. j * U + U - 1` (gathered by the Ulysses all-to-all). With the zigzag
    layout over 2P chunks this is again a zigzag pair over 2R chunks, for every U.
    """
    ring_size = sp_world_size // ulysses_degree
    return [
        torch.sort(
            torch.cat(
                [layout_indices(kind, j * ulysses_degree + u, sp_world_size, seq_len) for u in range(ulysses_degree)]
            )
        ).values
        for j in range(ring_size)
    ]


def ulysses_sort_order(
    kind: str, sp_world_size: int, ulysses_degree: int, ring_rank: int, seq_len: int
) -> torch.Tensor | None:
    """The permutation that sorts the Ulysses all-to-all's output (member shards in Ulysses-rank order)
    by global position, or None when it is already sorted (the contiguous layout)."""
    members = [
        layout_indices(kind, ring_rank * ulysses_degree + u, sp_world_size, seq_len) for u in range(ulysses_degree)
    ]
    order = torch.argsort(torch.cat(members))
    return None if bool(torch.equal(order, torch.arange(order.numel()))) else order

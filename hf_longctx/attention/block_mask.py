"""A flex-attention `BlockMask` for segment-causal attention, built without a dense `[sl, sl]` mask.

`segment_block_mask(segment_ids, window)` is the main function. torch's `create_block_mask`
evaluates the mask function on every `(query, key)` pair (a dense `[bs, 1, sl, sl]` tensor: 16 GiB
of booleans at 128K tokens) and only then reduces it to blocks. Here every `(query block, key
block)` pair is classified from its first and last segment ids and positions, exactly where a
block is *full* (every pair allowed: flex skips the mask function there) and conservatively where
it is *partial* (flex applies the mask function), so the result never differs from the rule
"causal, same segment, within the window"; only `[bs, 1, sl / 128, sl / 128]` block tables exist.
"""

from __future__ import annotations

import torch

BLOCK = 128  # flex-attention's default sparse block size


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(count, indices)` per query block: the key blocks set in `blocks`, listed first, in order."""
    as_int = blocks.to(torch.int32)
    count = as_int.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32)
    return count.contiguous(), indices.contiguous()


def classify_blocks(
    segment_ids: torch.Tensor, window: int | None, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial and full `[bs, 1, n_blocks, n_blocks]` block tables of the segment-causal rule.

    Args:
        segment_ids: `[bs, sl]` non-decreasing segment index per token (documents, chunks).
        window: sliding window (query i sees key j only if `i - j < window`), or None.
        block: the block size in tokens (query and key).

    Returns:
        `(partial, full)`, booleans: `full` where every pair of the block is allowed; `partial`
        where some pair may be (a superset of the blocks with an allowed pair, minus `full`).
    """
    sl = segment_ids.shape[1]
    start = torch.arange(0, sl, block, device=segment_ids.device)  # first token of each block
    end = torch.clamp(start + block - 1, max=sl - 1)  # last token
    first, last = segment_ids[:, start], segment_ids[:, end]  # [bs, n_blocks]
    qs, qe, ks, ke = start[:, None], end[:, None], start[None, :], end[None, :]
    # Some pair (i, j) with j <= i, same segment, i - j < window can exist only if:
    maybe = ks <= qe
    maybe = maybe & (first[:, None, :] <= last[:, :, None]) & (first[:, :, None] <= last[:, None, :])
    if window is not None:
        maybe = maybe & (qs - ke < window)
    # Every pair is allowed: the key block ends before the query block starts, one segment spans
    # both blocks (ids are non-decreasing), both blocks are whole, and the farthest pair is in the window.
    full = (ke < qs) & (first[:, None, :] == last[:, :, None]) & (qe - qs == block - 1) & (ke - ks == block - 1)
    if window is not None:
        full = full & (qe - ks < window)
    full = full & maybe
    return (maybe & ~full).unsqueeze(1), full.unsqueeze(1)


def segment_block_mask(segment_ids: torch.Tensor, window: int | None, block: int = BLOCK):
    """The flex `BlockMask` of "causal, same segment, within `window`" for `[bs, sl]` segment ids."""
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = classify_blocks(segment_ids, window, block)
    ids = segment_ids

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])
        return ok & (q_idx - kv_idx < window) if window is not None else ok

    sl = segment_ids.shape[1]
    counts, indices = _ordered(partial)
    full_counts, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(sl, sl)
    )

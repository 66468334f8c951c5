"""The attention rule of `SequenceContext` equals transformers' own masks on packed rows, for every
kernel family: the sdpa and eager block plans, the flex `BlockMask` tables and the flash varlen
segments are each expanded to a dense mask here (the library never builds one) and compared."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import Llama4TextConfig, MistralConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from hf_longctx.attention.block_mask import classify_blocks
from hf_longctx.attention.blocks import plan_segment
from hf_longctx.attention.kernels import SequenceContext, attention_chunk_size
from hf_longctx.attention.local import block_allowed

SMALL = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_hidden_layers=2)
# Packed rows: positions restart at 0 per document. The long one spans several 128-token flex blocks.
LAYOUTS = {"short": [5, 6], "long": [150, 7, 300, 40]}


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)


def _hf_mask(create, config, positions: torch.Tensor) -> torch.Tensor:
    sl = positions.shape[1]
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(1, sl, 8)
    mask = create(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=positions)
    return mask.expand(1, 1, sl, sl)


def _expected(rule: str, arg: int | None, positions: torch.Tensor) -> torch.Tensor:
    if rule == "causal":
        return _hf_mask(create_causal_mask, MistralConfig(**SMALL, sliding_window=None), positions)
    if rule == "window":
        return _hf_mask(create_sliding_window_causal_mask, MistralConfig(**SMALL, sliding_window=arg), positions)
    config = Llama4TextConfig(**SMALL, attention_chunk_size=arg, layer_types=["chunked_attention"] * 2)
    return _hf_mask(create_chunked_causal_mask, config, positions)


def _plan_mask(context: SequenceContext, window, chunk, always_mask: bool, max_elements: int) -> torch.Tensor:
    """The dense mask the sdpa / eager plan implies: each block's own mask placed at its rows and keys, per
    segment and repeat (`min_rows` 4: long segments and bands are cut into several query blocks)."""
    sl = context.position_ids.shape[1]
    dense = torch.zeros(context.position_ids.shape[0], 1, sl, sl, dtype=torch.bool)
    for row, segments in enumerate(context.segments(chunk)):
        for start, end in segments:
            for block in plan_segment(end - start, window, always_mask, max_elements, min_rows=4):
                part = block_allowed(block, window) if block.masked else torch.ones(block.rows, block.rows).tril()
                for i in range(block.repeat):
                    q0, q1, k0 = (start + x + i * block.rows for x in (block.q0, block.q1, block.k0))
                    assert start <= k0 and q1 <= end, "a block outside its segment"
                    assert not dense[row, 0, q0:q1].any(), "query rows covered twice"
                    dense[row, 0, q0:q1, k0:q1] = part.bool()
    return dense


def _flex_mask(context: SequenceContext, window, chunk) -> torch.Tensor:
    """The dense mask the flex tables imply: full blocks all True, partial ones by the mask function."""
    sl = context.position_ids.shape[1]
    mask = context.block_mask(window, chunk)
    partial = mask.to_dense()  # [bs, 1, n, n] partial | full
    full_only = torch.zeros_like(partial)
    counts, idx = mask.full_kv_num_blocks, mask.full_kv_indices
    for i in range(partial.shape[2]):
        full_only[0, 0, i, idx[0, 0, i, : counts[0, 0, i]].long()] = 1
    b = torch.zeros(1, dtype=torch.long)
    qi, kj = torch.arange(sl)[:, None], torch.arange(sl)[None, :]
    rule = mask.mask_mod(b, 0, qi, kj)
    blocks_q, blocks_k = qi // 128, kj // 128
    return (full_only[0, 0, blocks_q, blocks_k].bool() | (partial[0, 0, blocks_q, blocks_k].bool() & rule))[None, None]


CASES = [("causal", None), ("window", 1), ("window", 3), ("window", 100), ("chunk", 2), ("chunk", 64)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rule,arg", CASES)
def test_every_kernel_plan_matches_transformers_masks(layout, rule, arg):
    positions = _positions(LAYOUTS[layout])
    context = SequenceContext(positions)
    expected = _expected(rule, arg, positions)
    window, chunk = (arg, None) if rule == "window" else (None, arg if rule == "chunk" else None)
    # sdpa (unmasked causal per segment unless a window binds) and eager (every block masked), with
    # small blocks so that long segments are cut into several query blocks.
    for always_mask in (False, True):
        for max_elements in (64, 2**22):
            assert torch.equal(_plan_mask(context, window, chunk, always_mask, max_elements), expected)
    assert torch.equal(_flex_mask(context, window, chunk), expected)
    # flash varlen: each segment causal on its own (flash applies the window itself).
    if window is None:
        cu = context.varlen_kwargs(chunk)["cu_seq_lens_q"].tolist()
        varlen = torch.zeros_like(expected)
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            varlen[0, 0, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        assert torch.equal(varlen, expected)


@pytest.mark.parametrize("window", [None, 100])
def test_flex_tables_equal_torch_create_block_mask_and_attention_matches(window):
    positions = _positions(LAYOUTS["long"])
    context = SequenceContext(positions)
    ours = context.block_mask(window)
    sl = positions.shape[1]
    theirs = create_block_mask(ours.mask_mod, 1, None, sl, sl)  # the dense route, small here
    assert torch.equal(ours.full_kv_num_blocks, theirs.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, sl, 16, generator=g) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=_expected("window" if window else "causal", window, positions)
    )
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=ours), reference, atol=1e-5, rtol=1e-5)


def test_block_tables_are_exact_on_full_blocks():
    # Two documents of exactly two blocks each: every off-diagonal block inside a document is full.
    segment_ids = torch.cat([torch.zeros(256, dtype=torch.long), torch.ones(256, dtype=torch.long)]).unsqueeze(0)
    partial, full = classify_blocks(segment_ids, None)
    assert full[0, 0].nonzero().tolist() == [[1, 0], [3, 2]]
    assert partial[0, 0].nonzero().tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_chunked_varlen_segments_split_documents_at_chunk_starts():
    cu = SequenceContext(_positions([5, 6])).varlen_kwargs(chunk=4)["cu_seq_lens_q"].tolist()
    assert cu == [0, 4, 5, 9, 11]  # doc 1: [0..3], [4]; doc 2: [0..3], [4, 5]


def test_attention_chunk_size_reads_the_layer_type():
    config = Llama4TextConfig(**SMALL, attention_chunk_size=8, layer_types=["chunked_attention", "full_attention"])

    class Layer:
        def __init__(self, idx):
            self.config, self.layer_idx = config, idx

    assert attention_chunk_size(Layer(0)) == 8
    assert attention_chunk_size(Layer(1)) is None
    assert attention_chunk_size(object()) is None

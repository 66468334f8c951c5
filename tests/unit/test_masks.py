"""`SequenceContext` masks equal transformers' own mask functions on a packed row (pins the semantics)."""

from __future__ import annotations

import pytest
import torch
from transformers import Llama4TextConfig, MistralConfig
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_sliding_window_causal_mask,
)

from hf_longctx.attention.kernels import SequenceContext, attention_chunk_size

# Two packed documents of 5 and 6 tokens: positions restart at 0.
POSITIONS = torch.cat([torch.arange(5), torch.arange(6)]).unsqueeze(0)
EMBEDS = torch.zeros(1, 11, 8)
SMALL = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_hidden_layers=2)


def _hf_mask(create, config) -> torch.Tensor:
    config._attn_implementation = "sdpa"
    mask = create(config=config, inputs_embeds=EMBEDS, attention_mask=None, cache=None, position_ids=POSITIONS)
    return mask.expand(1, 1, 11, 11)


def test_document_causal_mask_matches_transformers():
    expected = _hf_mask(create_causal_mask, MistralConfig(**SMALL, sliding_window=None))
    assert torch.equal(SequenceContext(POSITIONS).allowed(None), expected)


@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_mask_matches_transformers(window):
    expected = _hf_mask(create_sliding_window_causal_mask, MistralConfig(**SMALL, sliding_window=window))
    assert torch.equal(SequenceContext(POSITIONS).allowed(window), expected)


@pytest.mark.parametrize("chunk", [2, 4, 16])
def test_chunked_mask_matches_transformers(chunk):
    config = Llama4TextConfig(**SMALL, attention_chunk_size=chunk, layer_types=["chunked_attention"] * 2)
    expected = _hf_mask(create_chunked_causal_mask, config)
    assert torch.equal(SequenceContext(POSITIONS).allowed(None, chunk), expected)


def test_chunked_varlen_segments_split_documents_at_chunk_starts():
    cu = SequenceContext(POSITIONS).varlen_kwargs(chunk=4)["cu_seq_lens_q"].tolist()
    assert cu == [0, 4, 5, 9, 11]  # doc 1: [0..3], [4]; doc 2: [0..3], [4, 5]


def test_attention_chunk_size_reads_the_layer_type():
    config = Llama4TextConfig(**SMALL, attention_chunk_size=8, layer_types=["chunked_attention", "full_attention"])

    class Layer:
        def __init__(self, idx):
            self.config, self.layer_idx = config, idx

    assert attention_chunk_size(Layer(0)) == 8
    assert attention_chunk_size(Layer(1)) is None
    assert attention_chunk_size(object()) is None

"""Attention that hf_longctx's causal document attention would compute differently is refused by name
(`attention/semantics.py`), at every SP size: at `sp_size=1` such a model keeps its own attention."""

from __future__ import annotations

import pytest
import torch

from hf_longctx.attention.registry import check_model
from hf_longctx.attention.semantics import attention_semantics_refusal
from hf_longctx.data.sharding import position_ids_from_seq_idx
from hf_longctx.integrations.trainer.single import document_attention_refusal
from tests._models import tiny_model

CONFIG = type("C", (), {"ulysses_head_chunks": 1})()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"prefix_lm": True}, "prefix_lm"),
        ({"layer_types": ["full_attention", "indexed_attention"]}, "indexed_attention"),
    ],
)
def test_config_that_asks_for_other_attention_is_refused(change, named):
    model = tiny_model("llama")
    assert attention_semantics_refusal(model) is None
    for key, value in change.items():
        setattr(model.config, key, value)
    with pytest.raises(ValueError, match=named):
        check_model(model, 2)
    assert named in document_attention_refusal(model, CONFIG)


def test_a_non_causal_attention_module_is_refused():
    model = tiny_model("llama")
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn .* is_causal=False"):
        check_model(model, 2)


def test_served_and_linear_layer_types_pass():
    model = tiny_model("llama")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert attention_semantics_refusal(model) is None
    model.config.layer_types = ["linear_attention", "full_attention"]  # `check_token_mixers` decides those
    assert attention_semantics_refusal(model) is None


def test_seq_idx_gives_positions_restarting_per_document():
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
    assert position_ids_from_seq_idx(seq_idx).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]

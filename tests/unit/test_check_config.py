"""`hf_longctx.check.shrink_config`: the small copy keeps heads, cuts layers and vocab, removes randomness."""

from __future__ import annotations

from transformers import PhimoeConfig

from hf_longctx.check import MAX_VOCAB, shrink_config


def test_shrink_config_keeps_heads_and_zeroes_training_noise():
    config = PhimoeConfig(
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=4 * MAX_VOCAB,
        attention_dropout=0.1,
        router_jitter_noise=0.01,
        input_jitter_noise=0.02,
    )
    small, notes = shrink_config(config, layers=2, hidden=64, min_positions=128, attn="eager")
    assert (small.num_hidden_layers, small.num_attention_heads, small.num_key_value_heads) == (2, 8, 2)
    assert (small.hidden_size, small.head_dim, small.vocab_size) == (64, 8, MAX_VOCAB)
    assert small.attention_dropout == small.router_jitter_noise == small.input_jitter_noise == 0.0
    assert any("router_jitter_noise 0.01 -> 0" in n for n in notes)
    assert small._attn_implementation == "eager" and not small.use_cache
    assert config.num_hidden_layers == 6 and config.router_jitter_noise == 0.01  # the original is untouched

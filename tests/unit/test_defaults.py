import math

import pytest
import torch

from hf_longctx.data import defaults
from hf_longctx.data.defaults import (
    HELD_OUT,
    gpt2_tokenizer,
    load_corpus,
    tiny_llama,
    tiny_llama_config,
    token_windows,
    window_dataset,
)

SMALL_DOCS = ("phoenix_and_the_turtle", "passionate_pilgrim")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return gpt2_tokenizer(str(tmp_path_factory.mktemp("cache") / "gpt2-tokenizer"))


@pytest.fixture(scope="module")
def small_corpus():
    return load_corpus(SMALL_DOCS)


def test_gpt2_tokenizer_matches_hub_ids(tok):
    assert tok("Hello world").input_ids == [15496, 995]
    assert tok.eos_token == tok.bos_token == tok.pad_token == tok.unk_token == "<|endoftext|>"
    assert tok.eos_token_id == 50256
    assert len(tok) == 50257
    assert tok.model_max_length == 1 << 30


def test_gpt2_tokenizer_round_trip(tok, small_corpus):
    text = small_corpus["phoenix_and_the_turtle"][:2000] + " naïve café — “quoted” 日本語\n\n  spaces"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text


def test_gpt2_tokenizer_reuses_cache(tmp_path):
    cache = tmp_path / "tok"
    first = gpt2_tokenizer(str(cache))
    saved = (cache / "tokenizer.json").stat().st_mtime_ns
    second = gpt2_tokenizer(str(cache))
    assert (cache / "tokenizer.json").stat().st_mtime_ns == saved
    assert first("to be, or not to be").input_ids == second("to be, or not to be").input_ids
    assert [p.name for p in tmp_path.iterdir()] == ["tok"]  # no temporary folder left behind


def test_corpus_has_42_sorted_docs_and_held_out_names():
    corpus = load_corpus()
    assert len(corpus) == 42
    assert list(corpus) == sorted(corpus)
    assert set(HELD_OUT) <= set(corpus)
    assert all(len(text) > 1000 for text in corpus.values())
    assert "Hamlet" in corpus["hamlet"] and "Lear" in corpus["lear"]
    assert "Prospero" in corpus["tempest"] and "Malvolio" in corpus["twelfth_night"]


def test_load_corpus_subset_and_unknown_name():
    assert list(load_corpus(["tempest", "hamlet"])) == ["hamlet", "tempest"]
    with pytest.raises(KeyError, match="no_such_play"):
        load_corpus(["hamlet", "no_such_play"])


@pytest.mark.parametrize("window", [64, 100, 257])
def test_token_windows_cut_each_document_exactly(tok, small_corpus, window):
    all_windows = []
    for text in small_corpus.values():
        ids = tok(text, add_special_tokens=False).input_ids
        windows = token_windows(tok, [text], window, min_len=1)
        assert all(len(w) == window for w in windows[:-1])
        assert 1 <= len(windows[-1]) <= window
        assert len(windows) == math.ceil(len(ids) / window)
        assert [t for w in windows for t in w] == ids
        all_windows += windows
    # several documents: windows stay inside their document, in input order
    assert token_windows(tok, small_corpus.values(), window, min_len=1) == all_windows


def test_token_windows_tail_and_limits(tok, small_corpus):
    text = small_corpus["phoenix_and_the_turtle"]
    n = len(tok(text, add_special_tokens=False).input_ids)
    assert [len(w) for w in token_windows(tok, [text], n - 1, min_len=1)] == [n - 1, 1]
    assert [len(w) for w in token_windows(tok, [text], n - 1)] == [n - 1]  # 1-token tail dropped
    assert token_windows(tok, [text], n + 5) == [tok(text, add_special_tokens=False).input_ids]
    assert len(token_windows(tok, small_corpus.values(), 32, max_windows=3)) == 3
    assert token_windows(tok, [text], 32, max_windows=0) == []
    with pytest.raises(ValueError):
        token_windows(tok, [text], 0)


def test_window_dataset_splits_are_disjoint(tok, monkeypatch):
    seen = {}

    def record(tokenizer, texts, window, *, max_windows=None, min_len=2):
        seen[window] = list(texts)
        return [[1, 2]]

    monkeypatch.setattr(defaults, "token_windows", record)
    window_dataset(tok, 1, split="train")
    window_dataset(tok, 2, split="eval")
    corpus = load_corpus()
    train, held = seen[1], seen[2]
    assert held == [corpus[name] for name in sorted(HELD_OUT)]
    assert train == [text for name, text in corpus.items() if name not in HELD_OUT]
    assert len(train) == 38 and not set(train) & set(held)
    with pytest.raises(ValueError, match="split"):
        window_dataset(tok, 8, split="test")


def test_window_dataset_columns_and_content(tok):
    ds = window_dataset(tok, 128, split="eval", max_windows=3)
    assert ds.column_names == ["input_ids"] and len(ds) == 3
    hamlet = tok(load_corpus(["hamlet"])["hamlet"], add_special_tokens=False).input_ids
    assert [t for row in ds["input_ids"] for t in row] == hamlet[: 3 * 128]


def test_tiny_llama_is_deterministic_and_about_7m_params(tok):
    rng_before = torch.random.get_rng_state()
    a, b, c = tiny_llama(tok), tiny_llama(tok), tiny_llama(tok, seed=1)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    n_params = sum(p.numel() for p in a.parameters())
    assert n_params == 50304 * 128 + 4 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128) + 128
    assert 7.1e6 < n_params < 7.3e6
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in a.parameters())

    ids = torch.tensor([tok("To be, or not to be, that is the question:").input_ids])
    with torch.no_grad():
        loss = a(input_ids=ids, labels=ids).loss
    assert abs(loss.item() - math.log(50304)) < 0.5  # random init: close to uniform


def test_tiny_llama_config_fields_and_overrides(tok):
    cfg = tiny_llama_config(tok)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 16)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (128, 384, 4)
    assert cfg.max_position_embeddings == 32768 and cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    assert cfg._attn_implementation == "sdpa"
    assert cfg.eos_token_id == cfg.pad_token_id == 50256
    assert tiny_llama_config(tok, num_hidden_layers=2).num_hidden_layers == 2
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_llama_config(tok, vocab_size=8192)

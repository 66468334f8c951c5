"""`corpus_documents` / `stream_documents`: the million-token recipes' rows, the shipped texts concatenated and cut
into documents of a fixed length, tokenized one text at a time."""

from __future__ import annotations

import random

import pytest

from hf_longctx.data.defaults import HELD_OUT, gpt2_tokenizer, load_corpus
from hf_longctx.data.long_documents import corpus_documents, stream_documents

POEMS = ("phoenix_and_the_turtle", "lovers_complaint", "passionate_pilgrim")


@pytest.fixture(scope="module")
def tok():
    return gpt2_tokenizer()


def _stream(tok, names, repeats, seed):
    """The token stream the documents are cut from, built the obvious way: every listing's texts in order."""
    texts = load_corpus(names)
    out = []
    for listing in range(repeats):
        order = list(names)
        random.Random(seed + listing).shuffle(order)
        for name in order:
            out += tok(texts[name], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def test_documents_are_the_concatenated_texts_cut_to_length_across_listings(tok):
    stream = _stream(tok, POEMS, repeats=3, seed=5)
    length = 2000
    docs = list(stream_documents(tok, POEMS, length, repeats=3, seed=5))
    assert len(docs) == len(stream) // length and len(docs) >= 4
    assert all(len(doc) == length for doc in docs)
    assert sum(docs, []) == stream[: len(docs) * length]  # nothing lost, repeated or reordered; the tail dropped
    # a document spans texts: the end-of-sequence token between two of them sits inside a document
    assert any(tok.eos_token_id in doc[:-1] for doc in docs)


def test_texts_are_read_only_when_the_stream_reaches_them(tok):
    reads = []

    def read(name):
        reads.append(name)
        return load_corpus([name])[name]

    first = next(stream_documents(tok, POEMS, 10, read=read))
    assert len(first) == 10 and len(reads) == 1  # one text tokenized for the first document, not the corpus
    assert len(list(stream_documents(tok, POEMS, 10, max_documents=3, read=read))) == 3
    assert len(reads) == 2


def test_corpus_documents_dataset_and_refusals(tok):
    data = corpus_documents(tok, 4096, split="eval", max_documents=5)
    assert data.column_names == ["input_ids"] and len(data) == 5
    assert all(len(row) == 4096 for row in data["input_ids"])
    assert data["input_ids"] == list(stream_documents(tok, HELD_OUT, 4096, max_documents=5))
    with pytest.raises(ValueError, match="shorter than one document"):
        corpus_documents(tok, 10_000_000, split="eval")
    with pytest.raises(ValueError, match="split"):
        corpus_documents(tok, 4096, split="test")
    with pytest.raises(ValueError, match="must be >= 1"):
        corpus_documents(tok, 0)

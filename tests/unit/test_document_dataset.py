"""`document_dataset`: the vendored texts whole (the million-token recipes' rows are packed from them)."""

from __future__ import annotations

import pytest

from hf_longctx.data.defaults import HELD_OUT, document_dataset, gpt2_tokenizer, load_corpus


def test_documents_are_whole_texts_with_eos_and_longer_ones_are_left_out():
    tok = gpt2_tokenizer()
    docs = list(document_dataset(tok, 4000)["input_ids"])
    texts = {k: v for k, v in load_corpus().items() if k not in HELD_OUT}
    whole = {tuple(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in texts.values()}
    assert docs and all(tuple(d) in whole and len(d) <= 4000 for d in docs)
    assert len(docs) == sum(len(w) <= 4000 for w in whole)  # every text that fits, none cut
    assert list(document_dataset(tok, 4000, repeats=3)["input_ids"]) == docs * 3
    with pytest.raises(ValueError, match="no vendored document fits"):
        document_dataset(tok, 10)

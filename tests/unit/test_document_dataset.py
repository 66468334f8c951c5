"""`document_dataset`: the vendored texts whole (the million-token recipes' rows are packed from them)."""

from __future__ import annotations

import pytest

from hf_longctx.data.defaults import document_dataset, gpt2_tokenizer, load_corpus

POEMS = ("phoenix_and_the_turtle", "lovers_complaint", "passionate_pilgrim", "sonnets")


def test_documents_are_whole_texts_with_eos_and_longer_ones_are_left_out():
    tok = gpt2_tokenizer()
    whole = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in load_corpus(POEMS).values()]
    limit = sorted(len(w) for w in whole)[2]  # the two shorter poems fit, the rest is longer
    docs = list(document_dataset(tok, limit, repeats=2, names=POEMS)["input_ids"])
    kept = [w for w in whole if len(w) <= limit]
    assert len(kept) == 3 and docs == kept * 2  # every text that fits, whole, listed twice; none cut
    with pytest.raises(ValueError, match="no vendored document fits"):
        document_dataset(tok, 10, names=POEMS)

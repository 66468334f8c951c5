"""Documents longer than a model's native context, built from the shipped corpus: the million-token recipes' data.

The vendored texts are concatenated (each followed by the end-of-sequence token) and the token stream is cut
into documents of exactly `length` tokens, so attention in one document spans many plays and poems and every
position up to `length - 1` is trained. This is how UltraLong-8B built its 1M-4M token continued-pretraining
rows from shorter documents (arXiv 2504.06214, section 3.1: documents concatenated to the target length, no
cross-document mask). The main entry point is `corpus_documents`; tokenization streams: one text and at most one
document's tokens are in memory at a time, and the rows go to an Arrow file on disk.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable, Iterator, Sequence

import datasets
from transformers import PreTrainedTokenizerBase

from hf_longctx.data.defaults import HELD_OUT, corpus_names, load_corpus


def stream_documents(
    tokenizer: PreTrainedTokenizerBase,
    names: Sequence[str],
    length: int,
    *,
    repeats: int = 1,
    seed: int = 0,
    max_documents: int | None = None,
    read: Callable[[str], str] | None = None,
) -> Iterator[list[int]]:
    """Yield documents of exactly `length` tokens cut from the texts `names`, concatenated `repeats` times.

    Listing `k` of the corpus takes the texts in the order `random.Random(seed + k).shuffle` gives them; the
    stream runs on across listings and the last, shorter piece is dropped. Each text is read and tokenized only
    when the stream reaches it.

    Args:
        tokenizer: the model's tokenizer; its `eos_token_id` (if any) follows every text.
        names: the texts (file stems of the vendored corpus).
        length: tokens per document.
        repeats: how many times the texts are listed.
        seed: the order of the texts in each listing.
        max_documents: stop after this many documents (later texts are never read).
        read: returns a text by name; default: the vendored corpus.

    Yields:
        Lists of `length` token ids.

    Raises:
        ValueError: `length`, `repeats` or `max_documents` below 1.
    """
    _check_sizes(length, repeats, max_documents)
    read = read or (lambda name: load_corpus([name])[name])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pending = array("q")  # tokens not yet in a document: less than one document plus one text
    emitted = 0
    for listing in range(repeats):
        order = list(names)
        random.Random(seed + listing).shuffle(order)
        for name in order:
            pending.extend(tokenizer(read(name), add_special_tokens=False)["input_ids"] + eos)
            while len(pending) >= length:
                yield pending[:length].tolist()
                del pending[:length]
                emitted += 1
                if emitted == max_documents:
                    return


def corpus_documents(
    tokenizer: PreTrainedTokenizerBase,
    length: int,
    *,
    repeats: int = 1,
    split: str = "train",
    seed: int = 0,
    max_documents: int | None = None,
) -> datasets.Dataset:
    """The shipped corpus as documents of `length` tokens (`stream_documents`), ready for packed SFT.

    With TRL's `packing=True` and `max_length == length` each document fills one row; its `position_ids` run
    from 0 to `length - 1`, so a model whose native context is shorter needs RoPE scaling (the recipes set YaRN).

    Args:
        tokenizer: the model's tokenizer.
        length: tokens per document.
        repeats: how many times the corpus is listed (one listing is about 1.4M GPT-2 tokens for `"train"`).
        split: `"train"` (every text but `HELD_OUT`) or `"eval"` (`HELD_OUT`).
        seed: the order of the texts in each listing.
        max_documents: keep at most this many documents.

    Returns:
        A `datasets.Dataset` with one column, `input_ids`, written to the datasets cache as it is generated.

    Raises:
        ValueError: an unknown `split`, invalid sizes, or a corpus shorter than one document.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    # A tuple: datasets splits list-valued gen_kwargs into shards, each its own stream.
    names = tuple(HELD_OUT) if split == "eval" else tuple(n for n in corpus_names() if n not in HELD_OUT)
    _check_sizes(length, repeats, max_documents)
    kwargs = dict(tokenizer=tokenizer, names=names, length=length, repeats=repeats, seed=seed)
    kwargs["max_documents"] = max_documents
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    try:
        return datasets.Dataset.from_generator(_rows, gen_kwargs=kwargs, features=features)
    except datasets.exceptions.DatasetGenerationError as error:  # datasets wraps what the generator raises
        if isinstance(error.__cause__, _NoDocument):
            raise ValueError(
                f"the corpus ({split} split, listed {repeats} time(s)) is shorter than one document of {length} "
                "tokens: raise repeats (document_repeats) or lower max_length"
            ) from None
        raise


def _check_sizes(length: int, repeats: int, max_documents: int | None) -> None:
    if min(length, repeats, 1 if max_documents is None else max_documents) < 1:
        raise ValueError(f"length ({length}), repeats ({repeats}) and max_documents ({max_documents}) must be >= 1")


class _NoDocument(ValueError):
    """The stream ended before its first document."""


def _rows(**kwargs) -> Iterator[dict[str, list[int]]]:
    empty = True
    for ids in stream_documents(**kwargs):
        empty = False
        yield {"input_ids": ids}
    if empty:
        raise _NoDocument

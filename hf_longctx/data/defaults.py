"""Offline defaults for the demo job: GPT-2 tokenizer, tiny Llama, vendored Shakespeare windows.

Everything is built from files shipped in ``hf_longctx/data`` and never touches the Hub. The main
entry points are ``gpt2_tokenizer``, ``tiny_llama`` and ``window_dataset``; provenance of the data
files is in ``scripts/vendor_data.py`` and the ``NOTICE`` files next to them.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from importlib.resources import files
from typing import TYPE_CHECKING

import datasets
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

EOT = "<|endoftext|>"
HELD_OUT = ("hamlet", "lear", "tempest", "twelfth_night")
DEFAULT_TOKENIZER_CACHE = os.path.join("~", ".cache", "hf_longctx", "gpt2-tokenizer")


def _data_path(*parts: str) -> Traversable:
    path = files("hf_longctx") / "data"  # one part per "/": namespace-package paths take only one
    for part in parts:
        path = path / part
    return path


def _read_gz(*parts: str) -> bytes:
    return gzip.decompress(_data_path(*parts).read_bytes())


def _build_gpt2_tokenizer() -> PreTrainedTokenizerFast:
    vocab = json.loads(_read_gz("gpt2_tokenizer", "encoder.json.gz"))
    lines = _read_gz("gpt2_tokenizer", "vocab.bpe.gz").decode("utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines if line and not line.startswith("#version")]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=EOT, eos_token=EOT, unk_token=EOT, pad_token=EOT)
    tok.model_max_length = 1 << 30  # long-context: silence the 1024-token length warning
    return tok


def gpt2_tokenizer(cache_dir: str | None = None) -> PreTrainedTokenizerFast:
    """The real GPT-2 byte-level BPE tokenizer (50,257 tokens), built from the vendored files.

    Built once, saved as ``tokenizer.json`` in ``cache_dir`` (atomically, so concurrent ranks are
    safe) and then always loaded with ``AutoTokenizer``. ``"<|endoftext|>"`` (id 50256) is the
    bos, eos, unk and pad token; ``model_max_length`` is ``1 << 30``.

    Args:
        cache_dir: folder holding the saved tokenizer; default ``~/.cache/hf_longctx/gpt2-tokenizer``.

    Returns:
        The tokenizer; ``tok("Hello world").input_ids == [15496, 995]``.

    Raises:
        OSError: the cache folder cannot be created or read.
    """
    out = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_TOKENIZER_CACHE))
    if not os.path.isfile(os.path.join(out, "tokenizer.json")):
        parent = os.path.dirname(out)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".gpt2-tokenizer-", dir=parent)
        try:
            _build_gpt2_tokenizer().save_pretrained(tmp)
            os.rename(tmp, out)  # atomic; fails if another process got there first
        except OSError:
            if not os.path.isfile(os.path.join(out, "tokenizer.json")):
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(out)


def tiny_llama_config(tokenizer: PreTrainedTokenizerBase, vocab_size: int = 50304, **overrides) -> LlamaConfig:
    """Config of the default 7.2 M-parameter Llama (4 layers, hidden 128, 8 query / 4 KV heads).

    Args:
        tokenizer: supplies the bos/eos/pad token ids.
        vocab_size: embedding rows; 50,304 is GPT-2's 50,257 padded to a multiple of 64.
        **overrides: any other ``LlamaConfig`` field, applied last.

    Returns:
        The config (fp32, ``attn_implementation="sdpa"``, tied embeddings, rope_theta 5e5).

    Raises:
        ValueError: ``vocab_size`` is smaller than the tokenizer's vocabulary.
    """
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=32768,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
        dtype="float32",
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_llama(tokenizer: PreTrainedTokenizerBase, seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` from ``tiny_llama_config``.

    The weights depend only on ``seed`` (so every rank and the SP=1 baseline get the same model);
    the global torch RNG state of the caller is left unchanged.

    Args:
        tokenizer: passed to ``tiny_llama_config``.
        seed: RNG seed for the initialisation.
        **overrides: passed to ``tiny_llama_config`` (``vocab_size`` included).

    Returns:
        The model, on CPU, in the config's dtype (fp32 by default).

    Raises:
        ValueError: from ``tiny_llama_config``.
    """
    config = tiny_llama_config(tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(config.dtype) if isinstance(config.dtype, torch.dtype) else model


def corpus_names() -> list[str]:
    """The file stems of the vendored Shakespeare texts (e.g. ``"hamlet"``), sorted; nothing is read."""
    root = _data_path("shakespeare")
    return sorted(p.name[: -len(".txt.gz")] for p in root.iterdir() if p.name.endswith(".txt.gz"))


def load_corpus(names: Sequence[str] | None = None) -> dict[str, str]:
    """The vendored Shakespeare texts (42 plays and poems, public domain).

    Args:
        names: file stems to load (e.g. ``"hamlet"``); ``None`` loads all of them.

    Returns:
        ``{name: text}`` sorted by name.

    Raises:
        KeyError: a requested name is not vendored.
    """
    available = corpus_names()
    missing = sorted(set(names or ()) - set(available))
    if missing:
        raise KeyError(f"unknown Shakespeare text(s) {missing}; available: {available}")
    wanted = available if names is None else sorted(set(names))
    return {name: _read_gz("shakespeare", f"{name}.txt.gz").decode("utf-8") for name in wanted}


def token_windows(
    tokenizer: PreTrainedTokenizerBase,
    texts: Iterable[str],
    window: int,
    *,
    max_windows: int | None = None,
    min_len: int = 2,
) -> list[list[int]]:
    """Tokenize each document and cut it into consecutive windows of ``window`` tokens.

    Windows never cross a document boundary and no special tokens are added, so concatenating one
    document's windows gives back its token ids (minus a dropped tail). Each document's last,
    partial window is kept only if it has at least ``min_len`` tokens (default 2: one
    next-token target); otherwise it is dropped. Order: documents in input order, then position.

    Args:
        tokenizer: any Hugging Face tokenizer.
        texts: the documents.
        window: tokens per window.
        max_windows: stop after this many windows (remaining documents are not tokenized).
        min_len: shortest tail window to keep.

    Returns:
        The windows, as lists of token ids.

    Raises:
        ValueError: ``window`` or ``min_len`` is smaller than 1, or ``max_windows`` is negative.
    """
    if window < 1 or min_len < 1:
        raise ValueError(f"window ({window}) and min_len ({min_len}) must be >= 1")
    if max_windows is not None and max_windows < 0:
        raise ValueError(f"max_windows must be >= 0, got {max_windows}")
    out: list[list[int]] = []
    for text in texts:
        if max_windows is not None and len(out) >= max_windows:
            break
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.extend(ids[i : i + window] for i in range(0, len(ids), window) if len(ids) - i >= min_len)
    return out if max_windows is None else out[:max_windows]


def window_dataset(
    tokenizer: PreTrainedTokenizerBase, window: int, *, split: str = "train", max_windows: int | None = None
) -> datasets.Dataset:
    """Fixed-length token windows of the vendored corpus, ready for packed-text SFT.

    Args:
        tokenizer: used to tokenize the texts (see ``token_windows``).
        window: tokens per window.
        split: ``"train"`` (every text except ``HELD_OUT``) or ``"eval"`` (only ``HELD_OUT``).
        max_windows: keep at most this many windows.

    Returns:
        A ``datasets.Dataset`` with one column, ``input_ids``.

    Raises:
        ValueError: unknown ``split``, or invalid window arguments.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if split == "eval":
        corpus = load_corpus(HELD_OUT)
    else:
        corpus = {k: v for k, v in load_corpus().items() if k not in HELD_OUT}
    windows = token_windows(tokenizer, corpus.values(), window, max_windows=max_windows)
    return datasets.Dataset.from_dict({"input_ids": windows})

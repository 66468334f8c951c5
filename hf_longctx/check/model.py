"""The model side of `hf-longctx check`: a small random-init copy of a local config, its batch, one step.

Shared by the parent (which computes the SP=1 reference with the plain model) and the torchrun workers.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_longctx.check import vlm
from hf_longctx.check.sequence import reference_router_term, router_term, switch_on_sequence_ops

MAX_VOCAB = 512
SEED = 0
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@dataclass
class StepResult:
    """One training step's outcome: loss, per-parameter gradients, weight fingerprint."""

    loss: float
    grads: dict[str, torch.Tensor]
    weights_sha256: str


def resolve_config_path(model: str) -> Path:
    """The local `config.json` that `model` names (a folder holding one, or the file itself).

    Args:
        model: a folder with `config.json`, or a path to a JSON config file.

    Returns:
        The path of the JSON file.

    Raises:
        ValueError: nothing usable at that path (the Hub is never consulted).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file() or path.suffix != ".json":
        raise ValueError(
            f"--model {model!r}: no config.json there. Pass a local folder holding config.json or the "
            "config.json file itself (the Hub is never used; download the config first)."
        )
    return path


def load_config(model: str) -> Any:
    """Load a local config with `AutoConfig` (offline).

    Args:
        model: see `resolve_config_path`.

    Returns:
        The `PreTrainedConfig`.

    Raises:
        ValueError: missing or unreadable config, or an architecture transformers does not know.
    """
    from transformers import AutoConfig

    path = resolve_config_path(model)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"--model {model!r}: cannot load {path}: {exc}") from exc


def head_counts(config: Any) -> tuple[int, int]:
    """`(num_attention_heads, num_key_value_heads)` of a (text) config; kv defaults to the query heads.

    Raises:
        ValueError: the config declares no attention heads (Ulysses splits attention heads).
    """
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(
            f"{type(config).__name__} has no num_attention_heads: Ulysses sequence parallelism splits "
            "attention heads, so this architecture cannot be checked."
        )
    kv = getattr(text, "num_key_value_heads", None)
    return int(heads), int(kv) if kv else int(heads)


def shrink_config(config: Any, *, layers: int, hidden: int, min_positions: int, attn: str) -> tuple[Any, list[str]]:
    """A small copy of `config` for the check: same attention heads, fewer layers, small vocab.

    Args:
        config: the original `PreTrainedConfig` (not modified).
        layers: `num_hidden_layers` of the copy.
        hidden: new hidden size (0 keeps it); head counts are kept, `head_dim = hidden / heads`
            and `intermediate_size = 2 * hidden`. Kept unchanged when `hidden` is not a multiple of
            `2 * num_attention_heads` (RoPE needs an even head dimension).
        min_positions: `max_position_embeddings` is raised to at least this.
        attn: attention implementation recorded in the copy.

    Returns:
        The shrunk copy and human-readable notes on what was kept or changed.
    """
    config = copy.deepcopy(config)
    text = config.get_text_config()
    notes: list[str] = []
    old_layers = int(text.num_hidden_layers)
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list) and len(text.layer_types) > layers:
        text.layer_types = text.layer_types[:layers]
    notes.append(f"layers {old_layers} -> {layers}")

    heads, _ = head_counts(config)
    if hidden:
        if hidden % (2 * heads) == 0:
            notes.append(f"hidden {text.hidden_size} -> {hidden} (head_dim {hidden // heads})")
            text.hidden_size = hidden
            text.head_dim = hidden // heads
            if hasattr(text, "intermediate_size"):
                text.intermediate_size = 2 * hidden
        else:
            notes.append(f"--hidden {hidden} is not a multiple of 2 x {heads} heads: kept hidden {text.hidden_size}")

    vocab = int(text.vocab_size)
    if vocab > MAX_VOCAB:
        text.vocab_size = MAX_VOCAB
        notes.append(f"vocab {vocab} -> {MAX_VOCAB}")
        for holder in {id(config): config, id(text): text}.values():
            for key in _TOKEN_ID_KEYS:
                value = getattr(holder, key, None)
                if isinstance(value, int) and value >= MAX_VOCAB:
                    setattr(holder, key, None)
                elif isinstance(value, list):
                    kept = [v for v in value if v < MAX_VOCAB]
                    setattr(holder, key, kept or None)

    if getattr(text, "max_position_embeddings", None) is not None and text.max_position_embeddings < min_positions:
        text.max_position_embeddings = min_positions
    for key, value in text.to_dict().items():
        # dropout and router/input jitter noise draw random numbers in train mode: SP and the reference
        # would draw different ones
        random_in_training = "dropout" in key or key.endswith("pdrop") or "jitter" in key
        if random_in_training and isinstance(value, float) and value != 0.0:
            setattr(text, key, 0.0)
            notes.append(f"{key} {value} -> 0")
    notes += switch_on_sequence_ops(text, min_positions)
    if vlm.is_vision_language(config):
        notes += vlm.shrink_vision(config, layers)
    text.use_cache = False
    config.use_cache = False
    config._attn_implementation = attn
    return config, notes


def build_model(config_dir: str | Path, attn: str, seed: int) -> torch.nn.Module:
    """The random-init float32 model of `config_dir` (its causal-LM class, or its image-text-to-text class
    for a vision-language config), identical for equal seeds, in train mode.

    Raises:
        ValueError: transformers has no such class for this config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    auto = AutoModelForImageTextToText if vlm.is_vision_language(config) else AutoModelForCausalLM
    torch.manual_seed(seed)
    try:
        model = auto.from_config(config, attn_implementation=attn, dtype=torch.float32)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ValueError(
            f"{type(config).__name__} (model_type {config.model_type!r}) has no {auto.__name__} class in "
            "transformers; hf-longctx check supports decoder-only causal LMs and Qwen-VL-style "
            "vision-language models."
        ) from None
    return model.float().train()


def weights_sha256(model: torch.nn.Module) -> str:
    """A fingerprint of every parameter's bytes (name order), to prove identical weights."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def make_batch(vocab_size: int, seq_len: int, batch_size: int, packed: bool, seed: int) -> dict[str, torch.Tensor]:
    """The deterministic full batch of the check.

    Row 0 has the labels of its first half (plus one token) set to -100, so at SP>=2 rank 0's
    shard has no valid label at all; with `packed`, every row holds three documents whose
    position ids restart at 0.

    Args:
        vocab_size: token ids are drawn from `[1, vocab_size)`.
        seq_len: sequence length (odd lengths exercise padding).
        batch_size: rows.
        packed: add restarting `position_ids` for three documents per row.
        seed: generator seed.

    Returns:
        `input_ids`, `labels` and, when packed, `position_ids`, all `[batch_size, seq_len]` int64.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (batch_size, seq_len), generator=gen)
    labels = ids.clone()
    labels[0, : (seq_len + 1) // 2 + 1] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = three_documents(seq_len, batch_size)
    return batch


def three_documents(seq_len: int, batch_size: int) -> torch.Tensor:
    """`[batch_size, seq_len]` positions of three documents per row (thirds, the last one longest)."""
    third = seq_len // 3
    lengths = (third, third, seq_len - 2 * third)
    return torch.cat([torch.arange(n) for n in lengths]).expand(batch_size, seq_len).clone()


def check_batch(model: torch.nn.Module, seq_len: int, batch_size: int, packed: bool, seed: int) -> dict[str, Any]:
    """The check's batch for `model`: image rows for a vision-language model (packed: three documents per row,
    no image across their boundaries), `make_batch` otherwise."""
    if vlm.is_vision_language(model.config):
        batch = vlm.make_batch(model, seq_len, batch_size, seed)
        return {**batch, "position_ids": three_documents(seq_len, batch_size)} if packed else batch
    return make_batch(model.config.get_text_config().vocab_size, seq_len, batch_size, packed, seed)


def step(model: torch.nn.Module, shard: dict[str, Any], groups: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward, SP loss (token loss and router loss) and backward on one shard; returns the loss and this rank's
    gradients."""
    from hf_longctx.loss import sequence_parallel_loss

    model.zero_grad(set_to_none=True)
    shift_labels = shard.pop("shift_labels")
    output = model(**shard)
    # The router loss comes whole on every SP rank, as the token loss from `sequence_parallel_loss`.
    loss = sequence_parallel_loss(output.logits, shift_labels, groups) + router_term(model, output)
    loss.backward()
    return loss.detach(), take_grads(model)


def take_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter's gradient (zeros where none), then clear them."""
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return grads


def reference_step(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> StepResult:
    """The SP=1 reference: the plain model (hf_longctx not enabled), one forward per document.

    The model builds its own masks (causal, sliding window, chunked), so SP is compared with what
    the model itself computes, not with the library's single-rank path. A packed row is run as
    separate documents, each with positions from 0, row after row in order, and the logits are concatenated:
    the ground truth packing stands for, whether or not the model's own mask code detects packed rows (some
    ignore `position_ids` and would attend across documents), with each document's own run-time RoPE and
    attention temperature (a dynamic RoPE's state moves on from one document to the next, as run alone).
    """
    from hf_longctx.data.sharding import document_starts, shard_batch_for_rank
    from hf_longctx.distributed.groups import SequenceParallelGroups
    from hf_longctx.loss import sequence_parallel_loss

    full = shard_batch_for_rank(batch, 0, 1)
    if vlm.is_vision_language(model.config):
        model.zero_grad(set_to_none=True)
        logits, outputs = vlm.reference_outputs(model, batch)
        loss = sequence_parallel_loss(logits, full["shift_labels"], SequenceParallelGroups.single())
        loss = loss + reference_router_term(model, outputs)
        loss.backward()
        return StepResult(loss.item(), take_grads(model), weights_sha256(model))
    ids, pos, shift_labels = full["input_ids"], full["position_ids"], full["shift_labels"]
    starts = document_starts(pos)
    model.zero_grad(set_to_none=True)
    if not bool(starts[:, 1:].any()):  # one document per row: the rows together, as the model trains on them
        outputs = [model(input_ids=ids, position_ids=pos)]
        logits = outputs[0].logits
    else:
        outputs, rows = [], []
        for row in range(ids.shape[0]):
            bounds = [*torch.nonzero(starts[row]).flatten().tolist(), ids.shape[1]]
            for s, e in zip(bounds[:-1], bounds[1:], strict=True):
                outputs.append(model(input_ids=ids[row : row + 1, s:e], position_ids=pos[row : row + 1, s:e]))
            rows.append(torch.cat([output.logits for output in outputs[-(len(bounds) - 1) :]], dim=1))
        logits = torch.cat(rows, dim=0)
    loss = sequence_parallel_loss(logits, shift_labels, SequenceParallelGroups.single())
    loss = loss + reference_router_term(model, outputs)
    loss.backward()
    return StepResult(loss.item(), take_grads(model), weights_sha256(model))


def valid_labels_per_rank(batch: Mapping[str, torch.Tensor], sp: int, layout: str = "contiguous") -> list[int]:
    """Number of valid shift labels in each SP rank's shard (pure; what the workers will see)."""
    from hf_longctx.data.sharding import IGNORE_INDEX, shard_batch_for_rank

    shards = [shard_batch_for_rank(batch, r, sp, layout=layout) for r in range(sp)]
    return [int((shard["shift_labels"] != IGNORE_INDEX).sum()) for shard in shards]

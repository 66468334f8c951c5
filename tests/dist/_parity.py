"""Shared pieces of the Ulysses parity tests: model specs, batch cases, the SP=1 reference, workers.

The reference is built independently of the library: document ids, position ids, the 4-D
document-causal mask and the shift labels all come from each case's explicit layout (document
lengths and padding per row), never from `hf_longctx`. Workers run in spawned gloo ranks through
`tests._dist.run_distributed` and loop over many (model, case) combinations per spawn.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_longctx
from hf_longctx.attention.registry import _HANDLE_ATTR
from hf_longctx.data.sharding import prepare_global_batch
from hf_longctx.distributed.comm import all_gather_sequence
from tests import _flash_standin as flash_standin
from tests._models import tiny_model

IGNORE = -100
VOCAB = 128
SEQ_LEN = 37  # odd: not divisible by 2 or 4, so sharding pads
LOSS_RTOL = 1e-6  # |loss_sp - loss_ref| / |loss_ref|
GRAD_RTOL = 1e-5  # max |grad_sp - grad_ref| / max |grad_ref|, per parameter


@dataclass(frozen=True)
class ModelSpec:
    """A tiny model shape; `build()` gives identical weights in every process (same seed)."""

    arch: str
    num_heads: int
    num_kv_heads: int
    hidden: int
    kind: str  # "mha", "gqa", "mqa" or "gqa_irregular"

    @property
    def id(self) -> str:
        return f"{self.arch}-{self.kind}{self.num_heads}x{self.num_kv_heads}-h{self.hidden}"

    def build(self, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
        """The model with kernel `attn`; "flash_attention_2" is the CPU stand-in (`tests/_flash_standin.py`)."""
        model = tiny_model(
            self.arch,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            hidden=self.hidden,
            layers=2,
            vocab=VOCAB,
            attn="eager" if attn == flash_standin.IMPLEMENTATION else attn,
            seed=seed,
        )
        return flash_standin.use_flash(model) if attn == flash_standin.IMPLEMENTATION else model


# Every head count is divisible by 4, so the same specs run at SP=2 and SP=4. At SP=4, 4x2 and 8x2
# send one replicated kv head per rank, 4x1 is MQA, and 12x3 copies a kv head per local query head.
MODEL_SPECS = (
    ModelSpec("llama", 4, 4, 64, "mha"),
    ModelSpec("llama", 4, 2, 64, "gqa"),
    ModelSpec("llama", 4, 1, 64, "mqa"),
    ModelSpec("llama", 12, 3, 192, "gqa_irregular"),
    ModelSpec("qwen3", 4, 4, 128, "mha"),
    ModelSpec("qwen3", 4, 2, 128, "gqa"),
    ModelSpec("qwen3", 4, 1, 128, "mqa"),
    ModelSpec("mistral", 4, 4, 64, "mha"),
    ModelSpec("mistral", 8, 2, 256, "gqa"),
    ModelSpec("mistral", 4, 1, 64, "mqa"),
)
# Kernels that read more than q, k and v (see tests/_models.py), with the kernels they support.
EXTRA_SPECS = (
    (ModelSpec("gpt_oss", 4, 2, 64, "sinks"), ("eager",)),
    (ModelSpec("deepseek_v3", 4, 4, 64, "mla"), ("sdpa", "eager")),
    (ModelSpec("gemma2", 4, 2, 64, "softcap"), ("eager",)),
    (ModelSpec("llama4", 4, 2, 64, "chunked"), ("sdpa", "eager")),
)
SPECS_BY_ID = {spec.id: spec for spec in MODEL_SPECS + tuple(spec for spec, _ in EXTRA_SPECS)}


@dataclass
class Case:
    """One batch and the layout the reference is built from."""

    name: str
    batch: dict[str, torch.Tensor]  # what a collator would hand to shard_batch
    position_ids: torch.Tensor  # [bs, sl] restarting at 0 per document
    doc_ids: torch.Tensor  # [bs, sl] document index per token (padding: its own id -1)
    valid: torch.Tensor  # [bs, sl] bool, False on padding
    shift_labels: torch.Tensor  # [bs, sl] hand-built reference labels


def _layout(rows: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position ids, document ids and validity from per-row document lengths (rest = right padding)."""
    bs = len(rows)
    pos = torch.zeros(bs, seq_len, dtype=torch.long)
    doc = torch.full((bs, seq_len), -1, dtype=torch.long)
    valid = torch.zeros(bs, seq_len, dtype=torch.bool)
    for b, lengths in enumerate(rows):
        t = 0
        for d, n in enumerate(lengths):
            for i in range(n):
                pos[b, t], doc[b, t], valid[b, t] = i, d, True
                t += 1
        for _ in range(seq_len - t):  # padding continues the row's positions
            pos[b, t] = pos[b, t - 1] + 1 if t else 0
            t += 1
    return pos, doc, valid


def hand_shift_labels(labels: torch.Tensor, doc_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Token t is trained to predict t+1 only when t+1 is a real token of the same document."""
    bs, sl = labels.shape
    out = torch.full((bs, sl), IGNORE, dtype=torch.long)
    for b in range(bs):
        for t in range(sl - 1):
            if valid[b, t] and valid[b, t + 1] and doc_ids[b, t] == doc_ids[b, t + 1]:
                out[b, t] = labels[b, t + 1]
    return out


def make_case(name: str) -> Case:
    """The batch cases of the parity suite, deterministic by name."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    packed = False
    if name == "seq37":  # one document, length not divisible by SP
        rows = [[SEQ_LEN]]
    elif name == "padded_bs2":  # batch 2, second row right-padded
        rows = [[SEQ_LEN], [26]]
    elif name == "packed3":  # one packed row of 3 documents
        rows, packed = [[12, 15, 10]], True
    elif name in ("completion_only", "one_label"):
        rows = [[SEQ_LEN], [SEQ_LEN]]
    else:
        raise ValueError(f"unknown case {name!r}")
    pos, doc, valid = _layout(rows, SEQ_LEN)
    ids = torch.randint(1, VOCAB, pos.shape, generator=gen)
    ids[~valid] = 0
    labels = ids.clone()
    labels[~valid] = IGNORE
    if name == "completion_only":
        # Prompts of 25 and 22 tokens: the first 19 (SP=2) or 20 (SP=4) shift labels are all masked.
        labels[0, :25] = IGNORE
        labels[1, :22] = IGNORE
    elif name == "one_label":
        # A single valid label in the whole batch: shift_labels[1, 29] (SP=2 rank 1, SP=4 rank 2).
        labels.fill_(IGNORE)
        labels[1, 30] = ids[1, 30]
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = pos.clone()
    if not bool(valid.all()):
        batch["attention_mask"] = valid.long()
    return Case(name, batch, pos, doc, valid, hand_shift_labels(labels, doc, valid))


CASE_NAMES = ("seq37", "padded_bs2", "packed3", "completion_only", "one_label")
FLASH = flash_standin.IMPLEMENTATION
# Specs whose flash path runs through the CPU stand-in: GQA, MQA, MHA, irregular, and the kernels with extras.
FLASH_SPECS = ("llama-gqa4x2-h64", "llama-mqa4x1-h64", "qwen3-mha4x4-h128", "llama-gqa_irregular12x3-h192")
FLASH_EXTRA = ("gpt_oss-sinks4x2-h64", "gemma2-softcap4x2-h64", "llama4-chunked4x2-h64")
# (spec id, attention kernel, case name): every case on sdpa, the packed row on eager too, and the flash
# varlen (packed, padded) and dense paths through the stand-in.
COMBOS = tuple(
    [(spec.id, "sdpa", case) for spec in MODEL_SPECS for case in CASE_NAMES]
    + [(spec.id, "eager", "packed3") for spec in MODEL_SPECS]
    + [(spec.id, attn, case) for spec, kernels in EXTRA_SPECS for attn in kernels for case in ("seq37", "packed3")]
    + [(spec_id, FLASH, case) for spec_id in FLASH_SPECS for case in ("packed3", "padded_bs2", "one_label")]
    + [(spec_id, FLASH, case) for spec_id in FLASH_EXTRA for case in ("seq37", "packed3")]
)


def reference_kernel(attn: str) -> str:
    """The kernel of the unsharded reference: flash takes no 4-D mask, so its reference runs on eager."""
    return "eager" if attn == FLASH else attn


def document_causal_mask(case: Case, window: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """Additive float `[bs, 1, sl, sl]`: query i sees key j <= i of its own document (padding: id -1),
    with `window` only keys with i - j < window, with `chunk` only keys in the same chunk of positions."""
    sl = case.doc_ids.shape[1]
    idx = torch.arange(sl)
    causal = idx[:, None] >= idx[None, :]
    if window is not None:
        causal = causal & (idx[:, None] - idx[None, :] < window)
    same_doc = case.doc_ids[:, :, None] == case.doc_ids[:, None, :]
    allowed = causal & same_doc
    if chunk is not None:
        block = case.position_ids // chunk
        allowed = allowed & (block[:, :, None] == block[:, None, :])
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min).unsqueeze(1)


def reference_mask(model: torch.nn.Module, case: Case) -> torch.Tensor | dict[str, torch.Tensor]:
    """The explicit mask; a mapping per layer type where the model alternates sliding and full layers
    (an explicit 4-D mask would otherwise drop the sliding windows)."""
    config = model.config
    if "chunked_attention" in (getattr(config, "layer_types", None) or []):
        return {
            "full_attention": document_causal_mask(case),
            "chunked_attention": document_causal_mask(case, chunk=config.attention_chunk_size),
        }
    if getattr(config, "layer_types", None) and getattr(config, "sliding_window", None):
        return {
            "full_attention": document_causal_mask(case),
            "sliding_attention": document_causal_mask(case, config.sliding_window),
        }
    return document_causal_mask(case)


def reference_loss_and_grads(model: torch.nn.Module, case: Case) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    """The unsharded run: explicit document-causal mask, mean CE over the hand-built shift labels."""
    model.zero_grad(set_to_none=True)
    mask = reference_mask(model, case)
    ids = case.batch["input_ids"]
    logits = model(input_ids=ids, position_ids=case.position_ids, attention_mask=mask).logits
    loss = F.cross_entropy(logits.flatten(0, 1), case.shift_labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads, logits.detach()


def grad_errors(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter max |g - g_ref| / max |g_ref| (0 when both are exactly zero)."""
    assert grads.keys() == ref.keys(), sorted(set(grads) ^ set(ref))
    out = {}
    for name, r in ref.items():
        diff = float((grads[name] - r).abs().max())
        scale = float(r.abs().max())
        out[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return out


def loss_error(loss: float, ref: float) -> float:
    return abs(loss - ref) / abs(ref)


# ---------------------------------------------------------------------------------------------
# Worker side (runs inside spawned gloo ranks).


def _sp_step(model, batch, groups, **loss_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard, forward, SP loss, backward; returns (loss, the shard's shift_labels)."""
    shard = hf_longctx.shard_batch(batch, groups)
    shift_labels = shard.pop("shift_labels")
    assert "labels" not in shard
    logits = model(**shard).logits
    loss = hf_longctx.sequence_parallel_loss(logits, shift_labels, groups, **loss_kwargs)
    loss.backward()
    return loss.detach(), shift_labels


def _averaged_grads(model, groups) -> dict[str, torch.Tensor]:
    """Gradients summed over the SP group and divided by its size, as a DP engine would."""
    names, grads = [], []
    for name, p in model.named_parameters():
        # A rank without any valid label must still produce every gradient (DDP would hang otherwise).
        assert p.grad is not None, f"no gradient for {name}"
        names.append(name)
        grads.append(p.grad.detach())
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=groups.sp_group)
    flat /= groups.sp_world_size
    out, offset = {}, 0
    for name, g in zip(names, grads, strict=True):
        out[name] = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()
    model.zero_grad(set_to_none=True)
    return out


def parity_worker(rank: int, world_size: int, combos: tuple[tuple[str, str, str], ...]) -> dict:
    """Run every (spec, attn, case) at SP=world_size; rank 0 returns the averaged gradients."""
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    flash_standin.install()
    results: dict = {}
    models: dict[tuple[str, str], tuple[torch.nn.Module, hf_longctx.SequenceParallelHandle]] = {}
    for spec_id, attn, case_name in combos:
        if (spec_id, attn) not in models:
            model = SPECS_BY_ID[spec_id].build(attn)
            models[(spec_id, attn)] = (model, hf_longctx.enable_sequence_parallel(model, groups))
        model, _ = models[(spec_id, attn)]
        case = make_case(case_name)
        loss, shift_labels = _sp_step(model, case.batch, groups)
        assert torch.isfinite(loss), f"{spec_id} {attn} {case_name}: loss {loss} on rank {rank}"
        masked = bool((shift_labels == IGNORE).all())
        masked_ranks = torch.tensor([int(masked)])
        dist.all_reduce(masked_ranks, group=groups.sp_group)
        if case_name in ("completion_only", "one_label"):
            # The point of these cases: some rank's shard has no valid label at all.
            assert int(masked_ranks) >= 1, f"{case_name}: every rank has a valid label"
        grads = _averaged_grads(model, groups)
        results[(spec_id, attn, case_name)] = {
            "loss": loss.item(),
            "shard_all_masked": masked,
            "masked_ranks": int(masked_ranks),
            "grads": grads if rank == 0 else None,
        }
    for _, handle in models.values():
        handle.remove()
    return results


# Specs of the world-2 feature checks.
ISOLATION_SPEC = SPECS_BY_ID["llama-gqa4x2-h64"]
SECOND_SPEC = SPECS_BY_ID["qwen3-mqa4x1-h128"]
CHECKPOINT_SPEC = SPECS_BY_ID["mistral-gqa8x2-h256"]


def _full_forward(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits


def _registry_keys() -> tuple[list[str], list[str]]:
    return sorted(ALL_ATTENTION_FUNCTIONS.keys()), sorted(ALL_MASK_ATTENTION_FUNCTIONS.keys())


def _isolation(groups) -> dict:
    """Another model of the same class is untouched while SP is on; remove() restores exactly."""
    full, packed = make_case("padded_bs2").batch, make_case("packed3").batch
    first, other = ISOLATION_SPEC.build(), ISOLATION_SPEC.build(seed=1)
    keys_before = _registry_keys()
    first_pre, other_pre = _full_forward(first, full), _full_forward(other, full)
    handle = hf_longctx.enable_sequence_parallel(first, groups)
    loss, _ = _sp_step(first, packed, groups)
    out = {
        "sp_loss": loss.item(),
        "sp_grads": _averaged_grads(first, groups),
        "other_during": _full_forward(other, full),
        "other_attn_during": other.config._attn_implementation,
        "first_attn_during": first.config._attn_implementation,
        "handle_key": handle.key,
        "keys_during": _registry_keys(),
    }
    handle.remove()
    handle.remove()  # idempotent
    out.update(
        first_pre=first_pre,
        other_pre=other_pre,
        first_post=_full_forward(first, full),
        other_post=_full_forward(other, full),
        first_attn_after=first.config._attn_implementation,
        handle_active_after=handle.active,
        has_handle_attr_after=hasattr(first, _HANDLE_ATTR),
        forward_pre_hooks_after=len(first._forward_pre_hooks),
        keys_before=keys_before,
        keys_after=_registry_keys(),
    )
    return out


def _two_models(groups) -> dict:
    """Two models with SP at once, calls interleaved: each uses its own key and context."""
    packed = make_case("packed3").batch
    keys_before = _registry_keys()
    a, c = ISOLATION_SPEC.build(), SECOND_SPEC.build()
    enable = hf_longctx.enable_sequence_parallel
    with enable(a, groups) as ha, enable(c, groups) as hc:
        shard = hf_longctx.shard_batch(packed, groups)
        shift_labels = shard.pop("shift_labels")
        logits_a = a(**shard).logits
        logits_c = c(**shard).logits
        loss_a = hf_longctx.sequence_parallel_loss(logits_a, shift_labels, groups)
        loss_c = hf_longctx.sequence_parallel_loss(logits_c, shift_labels, groups)
        (loss_a + loss_c).backward()
        out = {
            "keys": (ha.key, hc.key),
            "attn": (a.config._attn_implementation, c.config._attn_implementation),
            "loss_a": loss_a.item(),
            "loss_c": loss_c.item(),
            "grads_a": _averaged_grads(a, groups),
            "grads_c": _averaged_grads(c, groups),
        }
    out.update(keys_before=keys_before, keys_after=_registry_keys())
    return out


def _checkpointing(groups, *, forward_in_between: bool) -> dict:
    """Non-reentrant gradient checkpointing: layers (and their all-to-alls) are recomputed in backward.

    With `forward_in_between`, a no-grad forward on another layout (one document) runs between the
    packed row's forward and its backward: the recomputed layers must keep their own document mask.
    """
    packed = make_case("packed3").batch
    model = CHECKPOINT_SPEC.build()
    model.activation_checkpointing_enable({"use_reentrant": False})
    with hf_longctx.enable_sequence_parallel(model, groups):
        shard = hf_longctx.shard_batch(packed, groups)
        shift_labels = shard.pop("shift_labels")
        loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)
        if forward_in_between:
            other = hf_longctx.shard_batch(make_case("seq37").batch, groups)
            other.pop("shift_labels")
            with torch.no_grad():
                model(**other)
        loss.backward()
        grads = _averaged_grads(model, groups)
    return {"enabled": model.is_gradient_checkpointing, "loss": loss.item(), "grads": grads}


def _num_items(groups) -> dict:
    """num_items_in_batch = the global valid-token count (as int and as tensor) changes nothing."""
    batch = make_case("completion_only").batch
    count = int((prepare_global_batch(batch, 1)[0]["shift_labels"] != IGNORE).sum())
    model = ISOLATION_SPEC.build()
    out: dict = {"count": count}
    with hf_longctx.enable_sequence_parallel(model, groups):
        for name, kwargs in (
            ("default", {}),
            ("int", {"num_items_in_batch": count}),
            ("tensor", {"num_items_in_batch": torch.tensor(count)}),
        ):
            loss, _ = _sp_step(model, batch, groups, **kwargs)
            out[name] = loss.item()
            out[f"{name}_grads"] = _averaged_grads(model, groups)
    return out


FLEX_COMBOS = (("llama-gqa4x2-h64", "packed3"), ("llama4-chunked4x2-h64", "packed3"))


def _flex(groups) -> dict:
    """flex_attention's BlockMask path, forward only: torch compiles flex on CPU but has no CPU backward.
    Returns the SP logits gathered over the sequence, cut to the batch length."""
    out = {}
    for spec_id, case_name in FLEX_COMBOS:
        model = SPECS_BY_ID[spec_id].build("flex_attention")
        with torch.no_grad(), hf_longctx.enable_sequence_parallel(model, groups):
            shard = hf_longctx.shard_batch(make_case(case_name).batch, groups)
            shard.pop("shift_labels")
            logits = model(**shard).logits
        out[(spec_id, case_name)] = all_gather_sequence(logits, groups.sp_group)[:, :SEQ_LEN]
    return out


FEATURES = {
    "isolation": _isolation,
    "two_models": _two_models,
    "checkpointing": lambda groups: _checkpointing(groups, forward_in_between=False),
    "checkpointing_interleaved": lambda groups: _checkpointing(groups, forward_in_between=True),
    "num_items": _num_items,
    "flex": _flex,
}


def features_worker(rank: int, world_size: int) -> dict:
    """Each world-2 feature check; one that raises is reported (with its traceback) on its own.

    Every check runs the same collectives on both ranks, so an exception is raised symmetrically and
    the next check starts in step.
    """
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    out: dict = {}
    for name, check in FEATURES.items():
        try:
            out[name] = check(groups)
        except Exception:  # noqa: BLE001 - returned to the parent, which fails that one test
            out[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return out

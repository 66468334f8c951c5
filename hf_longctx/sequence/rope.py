"""RoPE whose frequencies depend on the sequence at run time, computed per document of the whole batch.

transformers' `dynamic_rope_update` decorator (dynamic NTK: `rope_type` containing "dynamic"; `"longrope"`, Phi-3
and PhiMoE) reads `torch.max(position_ids) + 1` of the positions the rotary module is given, rescales its inverse
frequencies and keeps state across forwards (`max_seq_len_cached`); PhiMoE's forward also picks its `mscale` from
it. Two things make that number wrong under hf_longctx: under SP a rank gives the module its shard's positions
(another length: gradients 63% off at SP=2 on one document, measured), and a packed row gives it the longest
document's length for every document (at every SP size).

transformers has no hook for the length, so each such rotary module gets an instance patch (`_patching.Patch`,
removed with the SP handle). The patched forward hands the module the batch's documents one after another, in
row order, as if each ran alone (`documents.document_runs`): for each run of consecutive documents of one length
it calls the module's own forward with this rank's tokens of that run plus ONE extra position, the run's largest
real position, and drops that column from the result. The module thus updates its state and picks its
frequencies exactly as it would for the documents run alone one after another, every rank walks every document
(a document with no token here is a one-position call), and each token's cos / sin come from its own document's
frequencies (RoPE is applied per token). SP padding takes its document's largest position (its cos / sin reach no
real token: causality hides it and no loss counts it). A batch of one document per row (unpacked rows, padding
aside) is one call with the batch's largest real position: what transformers computes for the rows together, and
what the run without SP gives.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from hf_longctx._patching import Patch
from hf_longctx.sequence.documents import DocumentRuns, document_runs
from hf_longctx.sequence.view import ShardView

RUNTIME_ROPE_TYPES = ("dynamic", "longrope")  # "dynamic" as a substring, as transformers tests it


@functools.cache
def _decorated_code() -> Any:
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


@functools.cache
def _reads_largest_position(forward: Any) -> bool:
    # PhiMoE's rotary forward also picks its mscale from `torch.max(position_ids) + 1` itself.
    try:
        return "max(position_ids)" in inspect.getsource(forward)
    except (OSError, TypeError):
        return False


def runtime_rope_types(module: torch.nn.Module) -> list[str]:
    """What of `module`'s RoPE reads the sequence at run time: its dynamic / longrope types, and "max(position_ids)"
    when its own forward reads it (empty: nothing, or not one of transformers' decorated rotary modules)."""
    forward = type(module).forward
    if getattr(forward, "__code__", None) is not _decorated_code():
        return []
    kinds = getattr(module, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    found = [k for k in kinds if isinstance(k, str) and ("dynamic" in k or k == "longrope")]
    return found + (["max(position_ids)"] if _reads_largest_position(inspect.unwrap(forward)) else [])


def _call_with(original: Callable[..., Any], x: torch.Tensor, positions: torch.Tensor, largest: torch.Tensor,
               args: tuple, kwargs: dict[str, Any]) -> list[torch.Tensor]:  # fmt: skip
    """The module's outputs for `positions` `[rows, n]` with `largest` appended to each row, that column dropped."""
    out = original(x, torch.cat([positions, largest.expand(*positions.shape[:-1], 1)], dim=-1), *args, **kwargs)
    out = list(out) if isinstance(out, tuple) else [out]
    for t in out:
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-2] != positions.shape[-1] + 1:
            raise ValueError(
                f"{type(getattr(original, '__self__', original)).__name__} returned an output that is not "
                "[..., positions, dim]: hf_longctx cannot give its run-time RoPE per-document frequencies."
            )
    return [t[..., :-1, :] for t in out]


def _per_run(original: Callable[..., Any], x: torch.Tensor, position_ids: torch.Tensor, runs: DocumentRuns,
             args: tuple, kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """Call the module once per run, in document order; each token's outputs from its own run's call."""
    if position_ids.dim() != 2:
        raise ValueError(
            f"The rotary embedding got position_ids of shape {tuple(position_ids.shape)}: hf_longctx gives run-time "
            "RoPE per-document frequencies for [batch, seq] positions only. Train this model unpacked (one document "
            "per row) or with a static RoPE scaling."
        )
    rows = runs.real.numel() // position_ids.shape[-1]
    if position_ids.shape[0] not in (1, rows):
        raise ValueError(
            f"The rotary embedding got position_ids for {position_ids.shape[0]} rows in a batch of {rows}: "
            "hf_longctx cannot tell each row's documents for its run-time RoPE."
        )
    flat = position_ids.expand(rows, -1).reshape(-1)  # one row of positions for every row: the model broadcasts it
    outputs: list[torch.Tensor] | None = None
    for largest, tokens in zip(runs.largest, runs.tokens, strict=True):
        top = flat.new_tensor(largest)
        positions = torch.where(runs.real[tokens].to(flat.device), flat[tokens.to(flat.device)], top)
        found = _call_with(original, x, positions.unsqueeze(0), top, args, kwargs)
        if outputs is None:
            outputs = [t.new_zeros(flat.numel(), t.shape[-1]) for t in found]
        for out, t in zip(outputs, found, strict=True):
            out[tokens.to(out.device)] = t.reshape(-1, t.shape[-1])
    assert outputs is not None  # a batch holds at least one document
    shaped = tuple(out.view(rows, position_ids.shape[-1], -1) for out in outputs)
    return shaped if len(shaped) > 1 else shaped[0]


def _memo_key(args: tuple, kwargs: dict[str, Any]) -> tuple:
    # The rotary module's other arguments (a layer type): by value when plain, else by identity.
    plain = lambda v: v if isinstance(v, (str, int, float, bool, type(None))) else id(v)  # noqa: E731
    return tuple(plain(a) for a in args), tuple((k, plain(v)) for k, v in sorted(kwargs.items()))


def _per_document(
    original: Callable[..., Any], view: Callable[[], ShardView | None], memo: dict[str, Any]
) -> Callable[..., Any]:
    def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        current = view()
        if current is None:  # not a forward hf_longctx serves (generation, a call outside the model's forward)
            return original(x, position_ids, *args, **kwargs)
        real = current.real_tokens()
        if real.numel() != position_ids.shape[-1]:
            raise ValueError(
                f"The rotary embedding got {position_ids.shape[-1]} positions for a shard of {real.numel()} tokens: "
                "hf_longctx cannot tell the documents of the whole sequence for its run-time RoPE."
            )
        # A model that calls its rotary module again in the same forward gets the same result, as each document
        # run alone would (walking the documents twice would move the module's state on).
        key = _memo_key(args, kwargs)
        if memo.get("view") is current and memo["key"] == key and torch.equal(memo["positions"], position_ids):
            return memo["out"]
        runs = document_runs(current)
        if len(runs) == 1 or not runs.packed:
            # One length for the whole batch, or one document per row (unpacked rows: transformers gives every row
            # the batch's longest, and so does the run without SP): one call, the shape as given.
            top = position_ids.new_tensor(max(runs.largest))
            positions = torch.where(real.to(position_ids.device), position_ids, top)
            found = _call_with(original, x, positions, top, args, kwargs)
            out = tuple(found) if len(found) > 1 else found[0]
        else:
            out = _per_run(original, x, position_ids, runs, args, kwargs)
        memo.update(view=current, key=key, positions=position_ids, out=out)
        return out

    return forward


class RuntimeRope:
    """The per-document patches of one model's run-time rotary modules (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, view: Callable[[], ShardView | None]) -> None:
        self.patches: list[Patch] = []
        self._memos: list[dict[str, Any]] = []
        for module in model.modules():
            if runtime_rope_types(module):
                memo: dict[str, Any] = {}
                patch = Patch(module, "forward", functools.partial(_per_document, view=view, memo=memo))
                patch.apply()
                self.patches.append(patch)
                self._memos.append(memo)

    def __bool__(self) -> bool:
        return bool(self.patches)

    def end_forward(self) -> None:
        """Drop the results kept for the forward that just ended (they hold its cos / sin)."""
        for memo in self._memos:
            memo.clear()

    def remove(self) -> None:
        """Restore every rotary module's own forward."""
        for patch in self.patches:
            patch.remove()
        self.patches.clear()
        self._memos.clear()


def patch_runtime_rope(model: torch.nn.Module, view: Callable[[], ShardView | None]) -> RuntimeRope:
    """Patch every run-time rotary module of `model` (see the module docstring); `.remove()` undoes it."""
    return RuntimeRope(model, view)

"""`tiled_mlp`: run each dense MLP over the sequence in tiles, recomputed tile by tile in backward.

`enable_tiled_mlp(model, tiles)` is the main entry. A dense MLP acts on every token on its own,
so running it on slices of the sequence and concatenating gives the same output; each tile runs
under `torch.utils.checkpoint` (non-reentrant), so the forward keeps only the MLP's input and the
backward recomputes one tile's intermediates (`[tile, intermediate_size]` activations) at a time
instead of the whole sequence's. DeepSpeed's `TiledMLP` does the same with its own autograd
function; the checkpoint route is used here because its recompute runs inside the ordinary
autograd graph, so each parameter's gradient hook fires once per backward as DDP, FSDP2 and ZeRO
expect (an inner `backward()` per tile would fire them once per tile).

Which modules: the `mlp` / `feed_forward` child of every decoder layer (transformers'
`GradientCheckpointingLayer`) that has no `experts`; in a mixture-of-experts block only its
shared expert(s) are tiled and the routed experts are left as they are (one log line per block
class): its router's logits feed the load-balancing loss, which a per-tile call would split.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from hf_longctx.distributed.comm import all_reduce_max
from hf_longctx.memory.tile_split import split_tiles
from hf_longctx.memory.tiling import auto_tiles

logger = logging.getLogger(__name__)

MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe")
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts", "shared_mlp")


def _is_moe(module: torch.nn.Module) -> bool:
    return hasattr(module, "experts") or hasattr(module, "router")


def _mixes_tokens(module: torch.nn.Module) -> bool:
    return any(isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d)) for m in module.modules())


def find_tiled_mlps(
    model: torch.nn.Module, skip: Collection[torch.nn.Module] = ()
) -> tuple[list[tuple[str, torch.nn.Module]], list[str]]:
    """The dense MLPs `tiled_mlp` tiles (not those in `skip`), and the class names of the blocks it leaves untiled."""
    skipped_ids = {id(m) for m in skip}
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: list[tuple[str, torch.nn.Module]] = []
    skipped: list[str] = []
    for name, layer in model.named_modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        for child_name in MLP_NAMES:
            block = getattr(layer, child_name, None)
            if not isinstance(block, torch.nn.Module) or id(block) in skipped_ids:
                continue
            if _mixes_tokens(block):
                skipped.append(type(block).__name__)
            elif not _is_moe(block):
                found.append((f"{name}.{child_name}", block))
            else:
                skipped.append(type(block).__name__)
                for shared in SHARED_EXPERT_NAMES:
                    expert = getattr(block, shared, None)
                    if isinstance(expert, torch.nn.Module) and not _is_moe(expert):
                        found.append((f"{name}.{child_name}.{shared}", expert))
    return found, skipped


def _zero3(module: torch.nn.Module) -> bool:
    """True when `module` holds DeepSpeed ZeRO-3 partitioned parameters inside a process group."""
    partitioned = any(getattr(p, "ds_status", None) is not None for p in module.parameters())
    return partitioned and dist.is_available() and dist.is_initialized()


class _AgreedTiles:
    """Tile counts every rank agrees on, one all-reduce per model forward (not one per MLP call).

    Under DeepSpeed ZeRO-3 every tile's call gathers the MLP's weights: all ranks must make the same
    number of calls even when their sequences differ, so they take the largest count. The first MLP
    call of a forward with a given hidden size agrees on it; later calls in that forward, and the
    checkpoint recompute of a grad forward in backward, reuse that value, so the collective runs at
    the same point on every rank and never in backward. A model forward pre-hook starts a new forward;
    grad and no-grad forwards keep separate values, so an evaluation forward between a training
    forward and its backward does not change the tiles the recompute uses.
    """

    def __init__(self) -> None:
        self._by_mode: dict[bool, dict[int, int]] = {}

    def new_forward(self, *_: Any) -> None:
        self._by_mode[torch.is_grad_enabled()] = {}

    def get(self, tiles: int, hidden_size: int) -> int:
        agreed = self._by_mode.setdefault(torch.is_grad_enabled(), {})
        if hidden_size not in agreed:
            # The default group: DeepSpeed gathers ZeRO-3 weights over every rank, not only the SP group.
            count = all_reduce_max(torch.tensor([tiles], dtype=torch.int64), dist.group.WORLD)
            agreed[hidden_size] = int(count.item())
        return agreed[hidden_size]


def tiled_call(forward: Callable[..., Any], x: torch.Tensor, tiles: int, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`forward(x, ...)` computed on `tiles` slices of `x` along its token dim (-2), concatenated.

    With gradients enabled each slice runs under non-reentrant checkpointing (only the slice is
    kept; backward recomputes the slice). Slices may be empty when `tiles` exceeds the tokens.

    Raises:
        ValueError: `forward` does not return a tensor shaped like its input's tokens.
    """
    outs = []
    for part in split_tiles(x, tiles, dim=-2):  # each slice's gradient lands in one buffer
        if torch.is_grad_enabled():
            out = checkpoint(forward, part, *args, use_reentrant=False, **kwargs)
        else:
            out = forward(part, *args, **kwargs)
        if not isinstance(out, torch.Tensor) or out.shape[:-1] != part.shape[:-1]:
            raise ValueError(
                "tiled_mlp / tiled_layer: a tiled module must map [..., tokens, hidden] to a tensor with the same "
                f"tokens; got {type(out).__name__}. Set tiled_mlp=False (or tiled_layer=False) for this model."
            )
        outs.append(out)
    return torch.cat(outs, dim=-2)


def _restore_forward(module: torch.nn.Module, own: Any) -> None:
    if own is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = own


class TiledMLPHandle:
    """Undo record of `enable_tiled_mlp`; `.remove()` restores every MLP's forward."""

    def __init__(self, model: torch.nn.Module, modules: list[str], skipped: list[str]) -> None:
        self.model, self.modules, self.skipped = model, modules, skipped
        self._undo: list[Callable[[], None]] = []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def enable_tiled_mlp(
    model: torch.nn.Module, tiles: bool | int = True, skip: Collection[torch.nn.Module] = ()
) -> TiledMLPHandle:
    """Tile the dense MLPs of `model` along the sequence (see the module docstring).

    Args:
        model: a transformers model whose decoder layers are `GradientCheckpointingLayer`s.
        tiles: True for `auto_tiles(tokens, hidden)` per call (agreed once per forward under ZeRO-3, see
            `_AgreedTiles`), or a fixed tile count >= 1.

    Returns:
        A handle listing the tiled modules (`.modules`) and skipped block classes (`.skipped`).

    Raises:
        ValueError: `tiles` is not True or a positive integer.
    """
    if not (tiles is True or (isinstance(tiles, int) and not isinstance(tiles, bool) and tiles >= 1)):
        raise ValueError(f"tiled_mlp must be True or a tile count >= 1, got {tiles!r}.")
    found, skipped = find_tiled_mlps(model, skip)
    handle = TiledMLPHandle(model, [name for name, _ in found], sorted(set(skipped)))
    agreed = _AgreedTiles()
    handle._undo.append(model.register_forward_pre_hook(agreed.new_forward).remove)
    for _, module in found:
        original = module.forward
        own = module.__dict__.get("forward")

        def forward(x: torch.Tensor, *args: Any, _original=original, _module=module, **kwargs: Any) -> torch.Tensor:
            n = auto_tiles(x.shape[:-1].numel(), x.shape[-1]) if tiles is True else tiles
            if tiles is True and _zero3(_module):
                n = agreed.get(n, x.shape[-1])
            if n <= 1 or x.dim() < 2:
                return _original(x, *args, **kwargs)
            return tiled_call(_original, x, n, *args, **kwargs)

        module.forward = forward
        handle._undo.append(functools.partial(_restore_forward, module, own))
    for name in handle.skipped:
        logger.info("hf_longctx: tiled_mlp leaves %s untiled (mixture of experts: only shared experts are tiled)", name)
    logger.info("hf_longctx: tiled_mlp on %d MLP modules of %s", len(found), type(model).__name__)
    return handle

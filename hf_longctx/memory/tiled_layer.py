"""`tiled_layer`: run each Llama-family decoder layer over sequence tiles, recomputed tile by tile in backward.

`enable_tiled_layer(model, tiles)` is the main entry. A layer runs in two passes over tiles of its
(local) sequence, each tile under non-reentrant `torch.utils.checkpoint` (so the recompute stays in
the ordinary autograd graph and each parameter's gradient hook fires once per backward, the
`tiled_mlp` rule): pass 1 computes the input norm and the rotated keys and values of every tile
(kept whole: attention needs them); pass 2, per query tile, the norm, queries, attention against the
whole K/V (`tile_attention`: LSE kernels, per-document causal; every tile's dK/dV summed in one float32
buffer, handed to K/V once), o_proj, residual, post-norm, MLP and
residual. Only the layer's input and output and K/V are sequence-long; everything else is one tile.
From forward to backward a tiled layer keeps only its input: the tiles' saved K/V are recomputed once
in backward (`_RecomputedKV`), so the layer is its own activation checkpoint (transformers' layer
checkpointing, which wraps the class forward, is bypassed for tiled layers). With `offload_activations`
what the tiles save of that input (views of it) goes through the offload's saved-tensor hooks: one host
copy per layer, fetched back once for the layer's backward, and no extra forward. Under Ulysses SP the
keys/values are exchanged to head shards once per layer, and each query tile's queries and attention
output are exchanged around its attention. Layers of another structure (or sliding windows, MoE,
soft-capping, sinks, dropout: `layer_match.untiled_reason`) and ring / hybrid SP run untiled, logged once.

The decoder stack's final norm (the `norm` next to its `layers`) is token-local too: it runs over the same
tiles, each checkpointed (`tiled_mlp.tiled_call`), so its backward holds one tile's temporaries instead of
transformers' RMSNorm backward's several `[T, h]` ones, the peak of a tiled model's step otherwise.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from hf_longctx.attention.kernels import SequenceContext
from hf_longctx.attention.registry import _HANDLE_ATTR as SP_HANDLE_ATTR
from hf_longctx.attention.registry import CONTEXT_KWARG as SP_CONTEXT_KWARG
from hf_longctx.attention.ulysses import check_shard, head_index, head_layout
from hf_longctx.distributed.comm import all_to_all
from hf_longctx.memory.layer_match import untiled_reason, weight_shape
from hf_longctx.memory.offload import HostOffload, offloaded_checkpoint
from hf_longctx.memory.tile_attention import KVGradients, plan_pieces, release_kv, tile_attention
from hf_longctx.memory.tile_split import split_tiles
from hf_longctx.memory.tiled_mlp import _AgreedTiles, _restore_forward, _zero3, tiled_call
from hf_longctx.memory.tiling import auto_tiles

logger = logging.getLogger(__name__)

_LOGGED: set[str] = set()


def _heads(x: torch.Tensor, proj: torch.nn.Module, norm: torch.nn.Module | None, head_dim: int) -> torch.Tensor:
    """`[bs, n, h]` -> projected, per-head normed `[bs, heads, n, hs]` (the attention forward's order)."""
    t = proj(x).view(*x.shape[:-1], -1, head_dim)
    return (norm(t) if norm is not None else t).transpose(1, 2)


class _TiledLayer:
    """The tiled forward of one decoder layer; `state` is shared by every layer of the model."""

    def __init__(self, layer: torch.nn.Module, state: _TiledState) -> None:
        self.layer, self.state = layer, state
        self.attn = layer.self_attn
        self.rotary = sys.modules[type(self.attn).__module__].apply_rotary_pos_emb
        self.original = layer.forward

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn, hs = self.attn, self.attn.head_dim
        h = self.layer.input_layernorm(x)
        k = _heads(h, attn.k_proj, getattr(attn, "k_norm", None), hs)  # [bs, hc_kv, n, hs]
        v = _heads(h, attn.v_proj, None, hs)
        return _attention_dtype(self.rotary(k, k, cos, sin)[1]), _attention_dtype(v)

    def tile(self, x, cos, sin, k, v, pieces, groups, kv_grads: KVGradients) -> torch.Tensor:
        attn, layer = self.attn, self.layer
        h = layer.input_layernorm(x)
        q = _heads(h, attn.q_proj, getattr(attn, "q_norm", None), attn.head_dim)  # [bs, hc, n, hs]
        q = _attention_dtype(self.rotary(q, q, cos, sin)[0])
        if groups is not None:
            q = all_to_all(q.contiguous(), scatter_dim=1, gather_dim=2, group=groups.sp_group)  # [bs, hc_l, ws*n, hs]
        o = tile_attention(q, k, v, pieces, attn.scaling, kv_grads).transpose(1, 2)  # [bs, ws*n, hc_l, hs_v]
        if groups is not None:
            o = all_to_all(o.contiguous(), scatter_dim=1, gather_dim=2, group=groups.sp_group)  # [bs, n, hc, hs_v]
        x = x + attn.o_proj(o.reshape(*x.shape[:-1], -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        sp = self.state.sp_handle()
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        embeddings = kwargs.get("position_embeddings")
        if args or cache is not None or embeddings is None or hidden_states.dim() != 3:
            self.state.log_once("a cache, positional arguments or no position_embeddings", "run untiled")
            return self.original(hidden_states, *args, **kwargs)
        if sp is not None and (sp.backend.name != "ulysses" or sp.backend.layout != "contiguous"):
            return self.original(hidden_states, *args, **kwargs)
        if sp is not None and not sp.groups.sp_enabled and (kwargs.get(SP_CONTEXT_KWARG) or sp.context) is None:
            self.state.log_once("a forward left to the model's own attention and mask (left padding)", "run untiled")
            return self.original(hidden_states, *args, **kwargs)
        n = min(self.state.tiles_for(hidden_states, self.layer), hidden_states.shape[1])  # no empty tiles
        if n <= 1:
            return self.original(hidden_states, *args, **kwargs)
        context = self.state.context(hidden_states, kwargs, sp)
        groups = sp.groups if sp is not None and sp.groups.sp_world_size > 1 else None

        return self.run(hidden_states, embeddings, context, groups, n)

    def whole_keys_values(self, parts: list[tuple], groups, run: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
        """K/V of the whole sequence (Ulysses: this rank's kv heads of the whole sequence), tile by tile."""
        kv = [run(self.keys_values, *p) for p in parts]
        k, v = torch.cat([t[0] for t in kv], dim=2), torch.cat([t[1] for t in kv], dim=2)  # [bs, hc_kv, sl_l, hs]
        if groups is None:
            return k, v
        layout = head_layout(self.attn.config.num_attention_heads, k.shape[1], groups.sp_world_size)
        if layout.kv_index is not None:  # each rank receives the kv heads its query heads read
            index = head_index(layout.kv_index, k.device)
            k, v = k.index_select(1, index), v.index_select(1, index)
        ws = groups.sp_world_size
        # One exchange for both: per destination rank, its k heads then its v heads. [bs, ws * 2 * kv_l, sl_l, hs]
        kv = torch.cat([k.unflatten(1, (ws, -1)), v.unflatten(1, (ws, -1))], dim=2).flatten(1, 2)
        kv = all_to_all(kv, scatter_dim=1, gather_dim=2, group=groups.sp_group)  # [bs, 2 * kv_l, sl, hs]
        return kv.chunk(2, dim=1)

    def recompute_kv(self, x_saved: Any, unpack: Callable[[Any], torch.Tensor], embeddings, n: int, groups, amp):
        """Backward's K/V: from the layer input as saved (its host copy under offload_activations), under the
        forward's autocast (autograd does not carry it into backward), so they equal the forward's."""
        with torch.autocast(amp[0], dtype=amp[2], enabled=amp[1]):
            return self.whole_keys_values(_parts(unpack(x_saved), embeddings, n), groups, _call)

    def run(self, x, embeddings, context: SequenceContext, groups, n: int) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        run = functools.partial(checkpoint, use_reentrant=False) if grad else _call
        offload = _host_offload(self.layer)
        # What the checkpoints save of x (its tiles): kept as is, or on the host under offload_activations.
        pack, unpack = offload.hooks((x,)) if offload is not None else (_same, _same)
        parts = _parts(x, embeddings, n)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack) if offload is not None else nullcontext()
        with hooks:
            k, v = self.whole_keys_values(parts, groups, run)
        x_saved = pack(x) if grad else x
        device = x.device.type
        amp = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        compute = functools.partial(self.recompute_kv, x_saved, unpack, embeddings, n, groups, amp)
        recompute = _RecomputedKV(k, v, compute, pack, unpack)
        kv_grads = KVGradients()  # every tile's dK/dV, summed in float32, reach K/V once (`tile_attention`)
        k, v = release_kv(k, v, kv_grads)
        ws, sl_l = (groups.sp_world_size if groups is not None else 1), x.shape[1]
        segments, outs, start = context.segments(), [], 0
        with torch.autograd.graph.saved_tensors_hooks(recompute.pack, recompute.unpack):
            for part in parts:
                length = part[0].shape[1]
                spans = [(r * length, r * sl_l + start, length) for r in range(ws)]  # contiguous shards
                outs.append(run(self.tile, *part, k, v, plan_pieces(segments, spans), groups, kv_grads))
                start += length
        recompute.forget()
        return torch.cat(outs, dim=1)


def _parts(x: torch.Tensor, embeddings: tuple[torch.Tensor, torch.Tensor], n: int) -> list[tuple]:
    """The layer input's `n` sequence tiles (their gradients reach `x` through one buffer), each with its rotary
    cos and sin."""
    cos, sin = (torch.tensor_split(t, n, dim=1) for t in embeddings)  # [bs, n, hs] each
    return list(zip(split_tiles(x, n, dim=1), cos, sin, strict=True))


def _same(t: Any) -> Any:
    return t


def _attention_dtype(t: torch.Tensor) -> torch.Tensor:
    """`t` in the autocast dtype when autocast is on for its device (what autocast does to sdpa's and flash's
    q, k, v in the untiled layer; the tile attention is an autograd function autocast does not reach)."""
    device = t.device.type
    if torch.is_autocast_enabled(device) and t.is_floating_point():
        return t.to(torch.get_autocast_dtype(device))
    return t


class _RecomputedKV:
    """Saved-tensor hooks that keep a layer's K/V out of the saved activations: the tiles save a marker,
    and the first unpack in backward recomputes K/V (no grad; values only, their gradients flow through the
    forward's graph) for every tile, dropped after the last. So a tiled layer keeps only its input, like a
    checkpointed one. Every other saved tensor goes through `outer` (the input's pack / unpack pair)."""

    def __init__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        compute: Callable[[], tuple[torch.Tensor, ...]],
        *outer: Callable[[Any], Any],
    ) -> None:
        self.kept: tuple[torch.Tensor, ...] = (k, v)
        self.compute = compute
        self.outer_pack, self.outer_unpack = outer
        self.values: tuple[torch.Tensor, ...] | None = None
        self.pending = 0

    def pack(self, t: torch.Tensor) -> Any:
        for i, kept in enumerate(self.kept):
            if t.data_ptr() == kept.data_ptr() and t.shape == kept.shape:
                self.pending += 1
                return i
        return self.outer_pack(t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, int):
            return self.outer_unpack(packed)
        if self.values is None:
            with torch.no_grad():
                self.values = self.compute()
        value = self.values[packed]
        self.pending -= 1
        if self.pending <= 0:  # below 0: a second backward over a retained graph, which recomputes again
            self.values = None
        return value

    def forget(self) -> None:
        """End of the forward: hold no reference to the forward's K/V."""
        self.kept = ()


def _host_offload(layer: torch.nn.Module) -> HostOffload | None:
    """The `offload_activations` hooks of this layer when it trains with gradients, else None."""
    func = layer.__dict__.get("_gradient_checkpointing_func")
    active = layer.gradient_checkpointing and layer.training and torch.is_grad_enabled()
    if active and isinstance(func, functools.partial) and func.func is offloaded_checkpoint:
        return func.args[0]
    return None


def _call(function: Callable[..., Any], *args: Any) -> Any:
    return function(*args)


class _TiledState:
    """What the tiled layers of one model share: tile counts, the SP handle and the mask check."""

    def __init__(self, model: torch.nn.Module, tiles: bool | int) -> None:
        self.model, self.tiles = model, tiles
        self.agreed = _AgreedTiles()
        self._checked_mask: tuple[int, int] | None = None

    def sp_handle(self) -> Any:
        handle = getattr(self.model, SP_HANDLE_ATTR, None)
        return handle if handle is not None and handle.active else None

    def tiles_for(self, x: torch.Tensor, layer: torch.nn.Module) -> int:
        if self.tiles is not True:
            return self.tiles
        n = auto_tiles(x.shape[:-1].numel(), x.shape[-1])
        return self.agreed.get(n, x.shape[-1]) if _zero3(layer) else n

    def context(self, x: torch.Tensor, kwargs: dict[str, Any], sp: Any) -> SequenceContext:
        """The forward's global documents: the SP context, or (no SP) the layer's `position_ids`."""
        if sp is not None:
            context = kwargs.get(SP_CONTEXT_KWARG) or sp.context
            sp.attention_calls += 1  # the SP handle's per-forward check counts attention layers
            check_shard(x.new_empty(x.shape[0], 1, x.shape[1], 1), context, sp.groups.sp_world_size)
            return context
        if SP_CONTEXT_KWARG in kwargs:
            raise ValueError(
                "tiled_layer could not find the SP handle of this model (a PEFT-wrapped model under SP?); "
                "set tiled_layer=False."
            )
        bs, sl = x.shape[:2]
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(sl, device=x.device).unsqueeze(0)
        context = SequenceContext(positions.expand(bs, sl))
        self._check_mask(kwargs.get("attention_mask"), context)
        return context

    def _check_mask(self, mask: Any, context: SequenceContext) -> None:
        """Without SP the model's mask must be the per-document causal mask the tiles apply, or that mask
        with right padding: every real token then sees what it sees untiled (loss and gradients exact);
        only the outputs at padding positions, which no loss reads, may differ."""
        if mask is None or (isinstance(mask, torch.Tensor) and (id(mask), mask.data_ptr()) == self._checked_mask):
            return
        ok = isinstance(mask, torch.Tensor) and mask.dim() in (2, 4)
        if ok:
            doc = context.doc_ids
            bs, sl = doc.shape
            if mask.dim() == 2:
                valid = mask.bool().expand(bs, sl)
            else:
                allowed = (mask if mask.dtype == torch.bool else mask == 0).expand(bs, 1, sl, sl)[:, 0]
                valid = allowed.any(dim=-2)  # [bs, sl] keys some query sees: the real tokens
            ok = bool((valid[:, 1:] <= valid[:, :-1]).all())  # right padding only
            if ok and mask.dim() == 4:
                causal = torch.ones(sl, sl, dtype=torch.bool, device=doc.device).tril()
                expected = (doc[:, :, None] == doc[:, None, :]) & causal & valid[:, None, :]
                ok = torch.equal(allowed[valid], expected[valid])  # the real query rows
        if not ok:
            raise ValueError(
                "tiled_layer: the attention mask is not the causal per-document mask of position_ids with at most "
                "right padding (left padding, a custom or flex mask); pass right-padded or packed rows or set "
                "tiled_layer=False."
            )
        self._checked_mask = (id(mask), mask.data_ptr())

    def log_once(self, why: str, what: str) -> None:
        if why not in _LOGGED:
            _LOGGED.add(why)
            logger.info("hf_longctx: tiled_layer: layers called with %s %s", why, what)


def _final_norms(model: torch.nn.Module, tiled: set[int]) -> list[tuple[str, torch.nn.Module]]:
    """The leaf `norm` of each decoder stack (a module whose `layers` hold a tiled layer): token-local."""
    found = []
    for name, module in model.named_modules():
        layers, norm = getattr(module, "layers", None), getattr(module, "norm", None)
        if not isinstance(layers, torch.nn.ModuleList) or not any(id(layer) in tiled for layer in layers):
            continue
        weight = getattr(norm, "weight", None)
        per_feature = isinstance(weight, torch.Tensor) and len(weight_shape(weight)) == 1
        across_tokens = isinstance(norm, (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm))
        if isinstance(norm, torch.nn.Module) and not list(norm.children()) and per_feature and not across_tokens:
            found.append((f"{name}.norm" if name else "norm", norm))
    return found


def _tiled_norm(forward: Callable[..., Any], norm: torch.nn.Module, state: _TiledState, x: torch.Tensor) -> Any:
    """The final norm over the layers' sequence tiles, each checkpointed (training only)."""
    if not torch.is_grad_enabled() or x.dim() != 3:
        return forward(x)
    n = min(state.tiles_for(x, norm), x.shape[1])
    return tiled_call(forward, x, n) if n > 1 else forward(x)


class TiledLayerHandle:
    """Undo record of `enable_tiled_layer`; `.remove()` restores every layer's forward.

    `.layers` names the tiled layers, `.untiled` maps the others to why, `.mlps` are the tiled layers' MLPs
    (`tiled_mlp` leaves them to this flag), `.norms` the tiled final norms."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers: list[str] = []
        self.norms: list[str] = []
        self.untiled: dict[str, str] = {}
        self.mlps: list[torch.nn.Module] = []
        self._undo: list[Callable[[], None]] = []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> TiledLayerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def enable_tiled_layer(model: torch.nn.Module, tiles: bool | int = True) -> TiledLayerHandle:
    """Tile the Llama-family decoder layers of `model` along the sequence (see the module docstring).

    Args:
        model: a transformers model (the one SP was enabled on, if any).
        tiles: True for `auto_tiles(tokens, hidden)` tiles per call (agreed across ranks under ZeRO-3),
            or a fixed tile count >= 1.

    Returns:
        A handle listing the tiled layers and why the others are untiled.

    Raises:
        ValueError: `tiles` is not True or a positive integer.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not (tiles is True or (isinstance(tiles, int) and not isinstance(tiles, bool) and tiles >= 1)):
        raise ValueError(f"tiled_layer must be True or a tile count >= 1, got {tiles!r}.")
    handle, state = TiledLayerHandle(model), _TiledState(model, tiles)
    sp = state.sp_handle()
    ring = sp is not None and sp.backend.name != "ulysses"
    handle._undo.append(model.register_forward_pre_hook(state.agreed.new_forward).remove)
    for name, layer in model.named_modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        reason = f"sp_backend {sp.backend.name!r} (ring attention is not tiled yet)" if ring else untiled_reason(layer)
        if reason is not None:
            handle.untiled[name] = reason
            continue
        own = layer.__dict__.get("forward")
        layer.forward = _TiledLayer(layer, state)
        handle._undo.append(functools.partial(_restore_forward, layer, own))
        handle.layers.append(name)
        handle.mlps.append(layer.mlp)
    for name, norm in _final_norms(model, {id(m) for n, m in model.named_modules() if n in handle.layers}):
        own = norm.__dict__.get("forward")
        norm.forward = functools.partial(_tiled_norm, norm.forward, norm, state)
        handle._undo.append(functools.partial(_restore_forward, norm, own))
        handle.norms.append(name)
    for name, reason in handle.untiled.items():
        logger.info("hf_longctx: tiled_layer leaves %s untiled: %s", name, reason)
    logger.info("hf_longctx: tiled_layer on %d layers of %s", len(handle.layers), type(model).__name__)
    return handle

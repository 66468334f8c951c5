"""Activation bytes of one sequence-tiled decoder layer (`tiled_layer`) on one rank, for `planner.estimate`.

`tiled_layer_bytes` is the main function. The layer runs its token-local parts (norms, projections, rotary,
o_proj, residual adds, MLP) one sequence tile at a time and attention per query tile against the K/V of the
whole sequence, recomputing each tile in backward (and K/V once). The terms follow the implementation as
first written on the `tiled` branch (commits ebcd39c, a2c42cc: `memory/tiled_layer.py`,
`memory/tile_attention.py` and the ring's LSE kernels it calls), read, not measured yet: every term is one
field of `TiledTerms`, so `plan_validate --tiled` can re-pin them one by one. With `offload_activations` the
plan is the design's (each layer's input on the host), which that implementation does not run yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_longctx.memory.tiling import auto_tiles
from hf_longctx.planner.model_shape import ModelShape, ceil_div
from hf_longctx.planner.terms import LayerBytes, kv_heads_per_rank, norm_bytes

if TYPE_CHECKING:
    from hf_longctx.planner.run import RunConfig


@dataclass(frozen=True)
class TiledTerms:
    """The named terms of one tiled layer, in bytes (see `tiled_terms` for each one's derivation)."""

    kv: float
    kv_grads: float
    kernel_call: float
    kv_forward: float
    tile_saved: float
    tile_mlp: float
    tile_forward: float
    tile_backward: float
    all_to_all: float


def layer_tiles(model: ModelShape, run: RunConfig, tokens: int) -> int:
    """Sequence tiles per layer call: the given count (at most one per token), or tiles of
    max(hidden, 4096) tokens for True (`memory.tiling.auto_tiles`, tiled_mlp's rule)."""
    if run.tiled_layer is True:
        return auto_tiles(tokens, model.hidden)
    return max(1, min(int(run.tiled_layer), tokens))


def tiled_terms(model: ModelShape, run: RunConfig, tokens: int, on_cpu: bool) -> TiledTerms:
    """Each tensor `terms.layer_bytes` counts for the untiled layer, sized for the tiled one.

    `T` rank tokens, `t` one tile's, `S = sp T` the keys, `H` / `Hkv` query / key-value heads (`kv_r` key-value
    heads per rank in the kernel's layout), `d` head dim, `I` MLP width, `a` activation bytes, `f` the MLP's
    saved factor (4, Liger 3). A query tile's attention runs as pieces (the prefix of its document, up to
    every key, and its causal diagonal block); a piece's kernel copies its keys and values contiguous.

    | tensor                                  | untiled bytes         | tiled bytes            | term          |
    | --------------------------------------- | --------------------- | ---------------------- | ------------- |
    | input, post-attention norm (saved)      | 2 T norm              | 2 t norm               | tile_saved    |
    | q/k norms, Qwen3 (saved)                | T (..)(H + Hkv)       | t (..)(H + Hkv)        | tile_saved    |
    | q, kernel layout (saved)                | a T H d               | a t H d                | tile_saved    |
    | k, v, kernel layout (saved)             | 2 a S kv_r d          | same, kept whole       | kv            |
    | log-sum-exp, fp32 (saved)               | 4 T H                 | 4 t H                  | tile_saved    |
    | kernel output = o_proj input (+SP copy) | a T H d (x2)          | a t H d (x2)           | tile_saved    |
    | MLP gate, act, up, product (saved)      | f a T I               | f a t I                | tile_mlp      |
    | router logits, MoE (saved)              | 4 T E                 | 4 t E                  | tile_mlp      |
    | MLP forward (gate, up, act)             | 3 a T I               | 3 a t I                | tile_forward  |
    | k, v per tile + concatenated (+ SP)     | -                     | 2 a T Hkv d (x2) + kv  | kv_forward    |
    | dq (+ fp32 accumulator, piece copies)   | a T H d               | (4 + 4a) t H d         | tile_backward |
    | dk, dv                                  | 2 a S kv_r d          | same (autograd's sum)  | kv_grads      |
    | fp32 dk, dv of one tile's backward      | -                     | 8 S kv_r d             | kernel_call   |
    |   + one piece's k, v copies and dk, dv  | -                     | 4 a S kv_r d           | kernel_call   |
    | flash-attn 2 fp32 dq accumulator, GPU   | 4 T H d               | 4 t H d                | tile_backward |
    | flash-attn 2 GQA dk, dv expanded, GPU   | 2 a T H d             | 2 a T H d (all keys)   | kernel_call   |
    | MLP backward (Liger: 1 a T I)           | 2 a T I               | 2 a t I                | tile_backward |
    | Ulysses send buffer                     | a T d (H + 2 S kv_r/T)| a t H d (q, then out)  | all_to_all    |
    | layer input, dout, dx (estimate.py)     | a T h each            | unchanged              | -             |

    The whole-length fp32 dk, dv (`tile_attention`'s accumulators over the pieces) and their cast to the
    compute dtype exist once per tile's backward, next to autograd's running sum of the tiles' K/V gradients.
    Head chunks do not apply inside a tiled layer (its queries are exchanged per tile). Eager attention is
    refused (`RunConfig`): it returns no log-sum-exp.
    """
    a, h, d, sp = run.act_bytes, model.hidden, model.head_dim, run.sp
    heads, width, liger = model.heads, model.mlp_width, run.liger_kernels
    kv_rank = kv_heads_per_rank(model, sp)
    T = tokens
    t = ceil_div(T, layer_tiles(model, run, T))
    kv = 2 * a * T * sp * kv_rank * d
    kv_seq = 2 * a * T * model.kv_heads * d  # the rank's own tokens' k, v, every key-value head
    tile_saved = 2 * t * norm_bytes(h, a, liger) + a * t * heads * d + 4 * t * heads
    tile_saved += a * t * heads * d * (1 if sp == 1 else 2)
    if model.qk_norm:
        tile_saved += t * (a * d + 4 if liger else (4 + a) * d + 4) * (heads + model.kv_heads)
    tile_mlp = a * t * width * (3 if liger else 4) + (4 * t * model.experts if model.experts else 0)
    tile_backward = (4 + 4 * a) * t * heads * d + a * t * width * (1 if liger else 2)
    kernel_call = 8 * T * sp * kv_rank * d + 2 * kv  # fp32 accumulators; one piece's k, v copies and dk, dv
    if run.attn == "flash" and not on_cpu:
        tile_backward += 4 * t * heads * d
        if kv_rank < heads // sp:
            kernel_call += 2 * a * T * heads * d
    return TiledTerms(
        kv=kv,
        kv_grads=kv,
        kernel_call=kernel_call,
        # Per-tile k, v (kept while the query tiles run) and, under SP, their concatenation before the exchange.
        kv_forward=kv_seq * (2 if sp > 1 else 1) + kv,
        tile_saved=tile_saved,
        tile_mlp=tile_mlp,
        tile_forward=3 * a * t * width,
        tile_backward=tile_backward,
        all_to_all=a * t * heads * d if sp > 1 else 0.0,
    )


def tiled_layer_bytes(model: ModelShape, run: RunConfig, tokens: int, on_cpu: bool) -> LayerBytes:
    """`LayerBytes` of one tiled layer: its recompute holds K/V and one tile's saved tensors; its backward
    adds the K/V gradients, one tile's whole-length kernel gradients and one tile's gradients."""
    terms = tiled_terms(model, run, tokens, on_cpu)
    tile = terms.tile_saved + terms.tile_mlp
    # Forward: the per-tile and whole K/V, one piece's k, v copies, one tile, and the output's tiles before
    # they are concatenated (the concatenation is the next layer's input, counted as a checkpoint).
    piece = terms.kv
    output_tiles = run.act_bytes * tokens * model.hidden
    return LayerBytes(
        saved=terms.kv + tile,
        saved_mlp=terms.tile_mlp,
        forward=terms.kv_forward + piece + tile + terms.tile_forward + output_tiles,
        backward=terms.kv_grads + terms.kernel_call + terms.tile_backward,
        all_to_all=terms.all_to_all,
        shared=0.0,
    )

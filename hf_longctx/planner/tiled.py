"""Activation bytes of one sequence-tiled decoder layer (`tiled_layer`) on one rank, for `planner.estimate`.

`tiled_layer_bytes` is the main function. The layer runs its token-local parts (norms, projections, rotary,
o_proj, residual adds, MLP) one sequence tile at a time and attention per query tile against the K/V of the
whole sequence, recomputing each tile in backward (and K/V once). The terms follow the implementation
(`memory/tiled_layer.py`, `memory/tile_attention.py` and the ring's LSE kernels it calls), each one a field of
`TiledTerms`, so `plan_validate --tiled` can re-pin them one by one; the CPU terms are measured there, the
GPU kernels' (flash-attn reading K/V in place, its GQA expansion) are read from their code.
With `offload_activations` each layer's input waits on the host (its tiles' saved views share one copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_longctx.memory.tiling import auto_tiles
from hf_longctx.planner.kernels import flash2_backward
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
    kernel_forward: float
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
    saved factor (4, Liger 3), `kv = 2 a S kv_r d` (K and V). A query tile's attention runs as pieces (the
    prefix of its document, up to every key, and its causal diagonal block). The piece kernel decides the
    copies (`_piece_bytes`): flash-attn (GPU, `--attn flash`) reads K/V in place; torch's CPU flash kernel
    copies a piece's k, v contiguous and returns its dk, dv; torch's efficient kernel (GPU without flash-attn)
    also expands k, v and their gradients to the query heads.

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
    | dk, dv                                  | 2 a S kv_r d          | fp32, every tile's sum | kv_grads      |
    | one piece's kernel temporaries          | -                     | `_piece_bytes`         | kernel_call   |
    | flash-attn 2 fp32 dq accumulator, GPU   | 4 T H d               | 4 t H d                | tile_backward |
    | MLP backward (Liger: 1 a T I)           | 2 a T I               | 2 a t I                | tile_backward |
    | Ulysses send buffer                     | a T d (H + 2 S kv_r/T)| a t H d (q, then out)  | all_to_all    |
    | layer input, dout, dx (estimate.py)     | a T h each            | unchanged              | -             |

    Every piece of every tile adds its dk, dv to one float32 sum over the whole sequence (`tile_attention.
    KVGradients`, `8 S kv_r d`), cast to K/V's dtype once after the last tile (while no piece's temporaries
    are alive). Head chunks do not apply inside a tiled layer (its queries are exchanged per tile). Eager attention is
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
    if flash2_backward(run, on_cpu):
        tile_backward += 4 * t * heads * d
    piece_forward, piece_backward = _piece_bytes(model, run, T, on_cpu)
    return TiledTerms(
        kv=kv,
        kv_grads=8 * T * sp * kv_rank * d,  # float32 dk, dv of every key, summed over the tiles
        kernel_call=piece_backward,
        kernel_forward=piece_forward,
        # Per-tile k, v (kept while the query tiles run) and, under SP, their concatenation before the exchange.
        kv_forward=kv_seq * (2 if sp > 1 else 1) + kv,
        tile_saved=tile_saved,
        tile_mlp=tile_mlp,
        tile_forward=3 * a * t * width,
        tile_backward=tile_backward,
        all_to_all=a * t * heads * d if sp > 1 else 0.0,
    )


def _piece_bytes(model: ModelShape, run: RunConfig, tokens: int, on_cpu: bool) -> tuple[float, float]:
    """A piece kernel's temporaries beyond the tile's buffers, in forward and in backward (a piece reads up to
    every key: `S` keys, `H / sp` query heads)."""
    a, d, sp = run.act_bytes, model.head_dim, run.sp
    kv = 2 * a * tokens * sp * kv_heads_per_rank(model, sp) * d
    expanded = 2 * a * tokens * model.heads * d  # k, v (or dk, dv) of every key for each of the rank's query heads
    if on_cpu:  # contiguous k, v copies; dk, dv returned, then added to the float32 sum
        return kv, 2 * kv
    if flash2_backward(run, on_cpu):  # K/V read in place; dk, dv returned, then added to the float32 sum
        gqa = expanded if kv_heads_per_rank(model, sp) < model.heads // sp else 0.0  # FlashAttention-2 expands GQA
        return 0.0, kv + gqa
    return expanded, 2 * expanded + kv  # torch's efficient kernel (fp32): expanded k, v and gradients, group sums


def tiled_layer_bytes(model: ModelShape, run: RunConfig, tokens: int, on_cpu: bool) -> LayerBytes:
    """`LayerBytes` of one tiled layer: its recompute holds K/V and one tile's saved tensors; its backward
    adds the K/V gradients, one tile's whole-length kernel gradients and one tile's gradients."""
    terms = tiled_terms(model, run, tokens, on_cpu)
    tile = terms.tile_saved + terms.tile_mlp
    # Forward: the per-tile and whole K/V, one piece kernel's copies, one tile, and the output's tiles before
    # they are concatenated (the concatenation is the next layer's input, counted as a checkpoint).
    output_tiles = run.act_bytes * tokens * model.hidden
    return LayerBytes(
        saved=terms.kv + tile,
        saved_mlp=terms.tile_mlp,
        forward=terms.kv_forward + terms.kernel_forward + tile + terms.tile_forward + output_tiles,
        backward=terms.kv_grads + terms.kernel_call + terms.tile_backward,
        all_to_all=terms.all_to_all,
        shared=0.0,
    )

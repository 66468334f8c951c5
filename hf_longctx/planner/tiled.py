"""Activation bytes of one sequence-tiled decoder layer (`tiled_layer`) on one rank, for `planner.estimate`.

`tiled_layer_bytes` is the main function. The layer runs its token-local parts (norms, projections, rotary,
o_proj, residual adds, MLP) one sequence tile at a time and attention per query tile against the K/V of the
whole sequence, recomputing each tile in backward; only K/V, their gradients and one kernel call's
key-length outputs are whole-sequence tensors inside it. Modelled from the design (issue 19), not measured
yet: every term is one field of `TiledTerms`, so `plan_validate --tiled` can re-pin them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_longctx.memory.tiling import auto_tiles
from hf_longctx.planner.model_shape import ModelShape, ceil_div
from hf_longctx.planner.terms import LayerBytes, head_chunk_kv, kv_heads_per_rank, norm_bytes

if TYPE_CHECKING:
    from hf_longctx.planner.run import RunConfig


@dataclass(frozen=True)
class TiledTerms:
    """The named terms of one tiled layer, in bytes (see `tiled_terms` for each one's derivation)."""

    kv: float
    kv_grads: float
    kernel_call: float
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

    `T` rank tokens, `t` one tile's, `sp` SP size, `C` head chunks, `H` / `Hkv_r` query / key-value heads
    (`Hkv_r` per rank in the kernel's layout, `Hkv_c` per head chunk), `d` head dim, `I` MLP width, `a`
    activation bytes, `f` the MLP's saved factor (4, Liger 3):

    | tensor                                  | untiled bytes         | tiled bytes         | term          |
    | --------------------------------------- | --------------------- | ------------------- | ------------- |
    | input, post-attention norm (saved)      | 2 T norm              | 2 t norm            | tile_saved    |
    | q/k norms, Qwen3 (saved)                | T (..)(H + Hkv)       | t (..)(H + Hkv)     | tile_saved    |
    | q, kernel layout (saved)                | a T H d               | a t H d             | tile_saved    |
    | k, v, kernel layout (saved)             | 2 a T sp Hkv_r d      | same, kept whole    | kv            |
    | log-sum-exp, fp32 (saved)               | 4 T H                 | 4 t H               | tile_saved    |
    | kernel output = o_proj input (+SP copy) | a T H d (x2)          | a t H d (x2)        | tile_saved    |
    | MLP gate, act, up, product (saved)      | f a T I               | f a t I             | tile_mlp      |
    | router logits, MoE (saved)              | 4 T E                 | 4 t E               | tile_mlp      |
    | MLP forward (gate, up, act)             | 3 a T I               | 3 a t I             | tile_forward  |
    | dq                                      | a T H d               | a t H d             | tile_backward |
    | dk, dv                                  | 2 a T sp Hkv_r d      | same (accumulators) | kv_grads      |
    | one kernel call's dk, dv, all keys      | -                     | 2 a T sp Hkv_c d    | kernel_call   |
    | flash-attn 2 fp32 dq accumulator, GPU   | 4 T H d / C           | 4 t H d / C         | tile_backward |
    | flash-attn 2 GQA dk, dv expanded, GPU   | 2 a T H d / C         | 2 a T H d / C       | kernel_call   |
    | MLP backward (Liger: 1 a T I)           | 2 a T I               | 2 a t I             | tile_backward |
    | Ulysses send buffer, one chunk          | a T d (H/C+2sp Hkv_c) | a t d (...)         | all_to_all    |
    | layer input, dout, dx (estimate.py)     | a T h each            | unchanged           | -             |

    The K/V gradients accumulate over the query tiles and are backpropagated through rotary and the k/v
    projections one tile at a time after the last one; a kernel call writes its own dk, dv for every key
    (flash-attn's and sdpa's backward write, not add), so both are whole. Head chunks slice a call's heads,
    not the K/V kept for all of them. Eager attention is refused (`RunConfig`): it returns no log-sum-exp.
    """
    a, h, d, sp = run.act_bytes, model.hidden, model.head_dim, run.sp
    heads, width, liger = model.heads, model.mlp_width, run.liger_kernels
    chunks = run.ulysses_head_chunks if sp > 1 else 1
    kv_rank, kv_chunk = kv_heads_per_rank(model, sp), head_chunk_kv(model, sp, chunks)
    T = tokens
    t = ceil_div(T, layer_tiles(model, run, T))
    kv = 2 * a * T * sp * kv_rank * d
    kernel_call = 2 * a * T * sp * kv_chunk * d
    tile_saved = 2 * t * norm_bytes(h, a, liger) + a * t * heads * d + 4 * t * heads
    tile_saved += a * t * heads * d * (1 if sp == 1 else 2)
    if model.qk_norm:
        tile_saved += t * (a * d + 4 if liger else (4 + a) * d + 4) * (heads + model.kv_heads)
    tile_mlp = a * t * width * (3 if liger else 4) + (4 * t * model.experts if model.experts else 0)
    tile_backward = a * t * heads * d + a * t * width * (1 if liger else 2)
    flash_gpu = run.attn == "flash" and not on_cpu
    if flash_gpu:
        tile_backward += 4 * t * heads * d / chunks
        if kv_rank < heads // sp:
            kernel_call += 2 * a * T * heads * d / chunks
    return TiledTerms(
        kv=kv,
        kv_grads=kv,
        kernel_call=kernel_call,
        tile_saved=tile_saved,
        tile_mlp=tile_mlp,
        tile_forward=3 * a * t * width,
        tile_backward=tile_backward,
        all_to_all=a * t * d * (heads // chunks + 2 * sp * kv_chunk) if sp > 1 else 0.0,
    )


def tiled_layer_bytes(model: ModelShape, run: RunConfig, tokens: int, on_cpu: bool) -> LayerBytes:
    """`LayerBytes` of one tiled layer: its recompute holds K/V and one tile's saved tensors; its backward
    adds the K/V gradients, one kernel call's key-length outputs and one tile's gradients."""
    terms = tiled_terms(model, run, tokens, on_cpu)
    tile = terms.tile_saved + terms.tile_mlp
    return LayerBytes(
        saved=terms.kv + tile,
        saved_mlp=terms.tile_mlp,
        forward=terms.kv + tile + terms.tile_forward,
        backward=terms.kv_grads + terms.kernel_call + terms.tile_backward,
        all_to_all=terms.all_to_all,
        shared=0.0,
    )

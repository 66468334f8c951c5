"""Activation bytes of one decoder layer and of the logits/loss, per rank, for `planner.estimate`.

Each count follows what autograd keeps alive in transformers' modules (RMSNorm upcasts its input to
fp32 and saves it; the gated MLP saves gate, activation, up and their product; flash kernels save
q, k, v, the output and the log-sum-exp) or in the Liger kernels that replace them. `T` is the
rank's tokens, `Sp` the padded sequence the attention kernel sees, `a` the activation dtype's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_longctx.attention.blocks import MASK_BLOCK_ELEMENTS, MIN_Q_BLOCK, plan_segment
from hf_longctx.memory.tiling import auto_tiles, tile_tokens
from hf_longctx.planner.kernels import flash2_backward, keeps_transformers_mask
from hf_longctx.planner.model_shape import ModelShape, ceil_div

if TYPE_CHECKING:
    from hf_longctx.planner.run import RunConfig


@dataclass(frozen=True)
class LayerBytes:
    """One decoder layer on one rank, in bytes.

    saved: what its backward needs (kept per layer without checkpointing; rebuilt one layer at a time
    with it). forward / backward: transients beyond `saved` while the layer runs. all_to_all: the
    packed send buffer of a Ulysses exchange. shared: per-forward buffers every layer reads (masks).
    """

    saved: float
    saved_mlp: float
    forward: float
    backward: float
    all_to_all: float
    shared: float


def norm_bytes(hidden: int, a: int, liger: bool) -> float:
    """Bytes per token an RMSNorm saves: transformers' saves its fp32 input, 1/rms and the normalised
    output before and after the weight; Liger's saves its input, output and 1/rms."""
    return 2 * a * hidden + 4 if liger else (4 + 2 * a) * hidden + 4


def kv_heads_per_rank(model: ModelShape, sp: int) -> int:
    """Key/value heads each rank receives in hf_longctx's Ulysses exchange (see `head_layout`)."""
    if sp == 1 or model.kv_heads % sp == 0:
        return model.kv_heads // sp
    q_local, group = model.heads // sp, model.heads // model.kv_heads
    return 1 if group % q_local == 0 else q_local


def valid_head_chunks(model: ModelShape, sp: int) -> list[int]:
    """`ulysses_head_chunks` values for this model at `sp` (as `attention.head_chunks.valid_head_chunks`): the
    divisors of the key/value heads a rank receives, or of its query heads when it receives one."""
    kv = kv_heads_per_rank(model, sp)
    unit = kv if kv > 1 else model.heads // sp
    return [c for c in range(1, unit + 1) if unit % c == 0]


def head_chunk_kv(model: ModelShape, sp: int, chunks: int) -> int:
    """Key/value heads one head chunk receives per rank: a slice of the rank's, or its one head every time."""
    kv = kv_heads_per_rank(model, sp)
    return kv // chunks if kv > 1 else 1


def mlp_tiles(model: ModelShape, run: RunConfig, tokens: int) -> int:
    """MLP tiles per layer call: the given count, or ceil(tokens / max(hidden, 4096)) for True; 1 = untiled
    (the implementation then runs the MLP as is)."""
    if run.tiled_mlp is False:
        return 1
    if run.tiled_mlp is True:
        return auto_tiles(tokens, model.hidden)
    return max(1, min(int(run.tiled_mlp), tokens))


def eager_scores(seq: int, sp: int) -> int:
    """Score elements of one head's causal attention over `seq` tokens. transformers' eager (no SP) scores
    the whole `[seq, seq]`; hf_longctx's runs blocks of queries against the keys up to the block's end."""
    if sp == 1:
        return seq * seq
    q_block = min(seq, max(MIN_Q_BLOCK, MASK_BLOCK_ELEMENTS // seq))  # as `kernels.plan_blocks`
    full, rest = divmod(seq, q_block)  # block k (0-based) scores q_block x (k + 1) * q_block; the rest x seq
    return q_block * q_block * full * (full + 1) // 2 + rest * seq


def band_bytes(seq: int, window: int, run: RunConfig, tokens: int, heads: int, d: int, kv: int) -> tuple[float, float]:
    """`(saved, gradients)`: what a sliding-window layer's band (`blocks.plan_segment` over one `seq`-token document,
    `attention/local.py`) keeps beyond the unbanded kernel's q, k, v, LSE and output, and the gradients of its
    copies in backward, on one rank of `tokens` tokens with `heads` query and `kv` key-value heads per rank in the
    kernel's layout (`heads * seq` = `heads_model * tokens` per sequence).

    transformers' `repeat_kv` expands each block's K/V window (a view of K/V: a slice, or an `unfold` for the
    batched inner blocks) to the query heads: a copy, except with one key-value head per rank or none to expand
    (then a stride-0 view sdpa reads in place); eager's matmuls copy them always, and the batched queries too.
    sdpa keeps each distinct masked block's mask as a float copy and the blocks' outputs beside their
    concatenation (without SP: with SP the all-to-all back takes the concatenation and o_proj its own output, as
    unbanded); without SP, when every block reads a copy, K and V themselves are not kept (`qkv` counts them)."""
    a, eager = run.act_bytes, run.attn == "eager"
    blocks = plan_segment(seq, window, eager)
    one = a * run.micro_batch * seq * heads * d  # one [seq, heads, d] tensor of the kernel's layout
    copied = eager or 1 < kv < heads
    keys = sum(b.repeat * b.keys for b in blocks if eager or b.masked) / seq
    windows = 2 * one * keys if copied else 0.0
    if eager:
        batched = sum(b.repeat * b.rows for b in blocks if b.repeat > 1) / seq
        return windows + one * batched, windows
    masks = a * sum(b.rows * b.keys for b in blocks if b.masked)
    in_place = not copied or any(not b.masked for b in blocks)
    originals = 0.0 if in_place or run.sp > 1 else 2 * a * tokens * kv * d
    outputs = one if run.sp == 1 else 0.0  # with SP the exchange back, not o_proj, reads the concatenation
    return windows + outputs + masks - originals, windows


def segment_scores(seq: int, window: int | None, chunk: int | None) -> int:
    """Score elements of one head's eager attention over one `seq`-token document of a windowed or chunked
    layer: the band's blocks, or each chunk's query blocks (`blocks.plan_segment`)."""
    if chunk is None:
        return sum(b.scores for b in plan_segment(seq, window, True))
    full, rest = divmod(seq, chunk)
    per_chunk = sum(b.scores for b in plan_segment(chunk, None, True))
    return full * per_chunk + (sum(b.scores for b in plan_segment(rest, None, True)) if rest else 0)


def layer_bytes(
    model: ModelShape, run: RunConfig, tokens: int, on_cpu: bool, kind: str = "full_attention"
) -> LayerBytes:
    """Saved and transient bytes of one decoder layer on one rank (see the module docstring), of attention `kind`
    (`ModelShape.layer_types`).

    A sliding-window layer on sdpa or eager (not flash-attn, which takes the window itself) runs as a band of
    query blocks, each with the K/V window of its queries (`band_bytes`; eager scores the band's blocks). A
    chunked layer runs per chunk: its outputs are concatenated (one more output on sdpa), and eager scores each
    chunk alone. flash-attn runs both on the full sequence, as a full layer."""
    a, h, d, sp = run.act_bytes, model.hidden, model.head_dim, run.sp
    heads, width, liger = model.heads, model.mlp_width, run.liger_kernels
    kv = kv_heads_per_rank(model, sp)
    T = tokens
    seq = tokens * sp // run.micro_batch  # tokens of one sequence the kernel sees
    q_local = heads // sp
    qkv = a * T * d * (heads + 2 * sp * kv)  # q, k, v in the kernel's head-sharded layout
    out = a * T * heads * d
    # Head chunks (`attention/head_chunks.py`, SP only): the attention saves its sequence-sharded q/k/v
    # inputs and the output; every full-sequence tensor exists for one chunk at a time, in forward and in
    # the backward's recompute, next to the q/k/v gradients the backward fills chunk by chunk.
    chunks = run.ulysses_head_chunks if sp > 1 else 1
    qkv_chunk = a * T * d * (heads // chunks + 2 * sp * head_chunk_kv(model, sp, chunks)) if chunks > 1 else qkv

    saved_attn = T * norm_bytes(h, a, liger)
    if model.qk_norm:
        # Per query and key head: the norm's input (fp32 for transformers' norm), its output and 1/rms.
        per_head = a * d + 4 if liger else (4 + a) * d + 4
        saved_attn += T * per_head * (heads + model.kv_heads)
    shared = 0.0
    window = model.sliding_window if kind == "sliding_attention" and model.sliding_window < seq else None
    chunk = model.attention_chunk if kind == "chunked_attention" and model.attention_chunk < seq else None
    banded = window is not None and run.attn != "flash"
    # The band's extra saved tensors and its windows' gradients (`band_bytes`).
    band, band_grads = band_bytes(seq, window, run, T, q_local, d, kv) if banded else (0.0, 0.0)
    # Chunks: one call per chunk, the outputs concatenated (without SP a second output kept: the kernel's own, beside
    # o_proj's input; eager keeps none of its own).
    split_out = out if chunk is not None and run.attn == "sdpa" and sp == 1 else 0.0
    if run.attn == "eager":
        scores = segment_scores(seq, window, chunk) if window or chunk else eager_scores(seq, sp)
        quadratic = run.micro_batch * q_local * scores  # score elements per layer on this rank
        # repeat_kv expands k and v to the local query heads (the band: its windows, in `band`); softmax output in
        # fp32 (+ its cast).
        expanded = 0.0 if banded else 2 * a * T * heads * d
        kernel_saved = a * T * heads * d + expanded + band + (qkv - a * T * heads * d if sp > 1 else 0)
        kernel_saved += quadratic * (4 + (a if a < 4 else 0))
        saved_attn += out  # o_proj input
        if keeps_transformers_mask(model, run):
            shared = run.micro_batch * seq * seq * a  # transformers' additive [seq, seq] mask, one per forward
        # Gradient of the probabilities, of the softmax input (fp32) and, in bf16, of the cast between.
        attn_bwd = quadratic * (a + 4 + (4 if a < 4 else 0)) + qkv + band_grads
    else:
        kernel_saved = qkv + 4 * T * heads + band + split_out  # q, k, v and the fp32 log-sum-exp
        # The kernel's output is o_proj's input without SP (flash and sdpa write [bs, sl, hc, hs]); with
        # SP the all-to-all back makes a second copy.
        copies = 1 if sp == 1 else 2
        kernel_saved += (copies - 1) * out
        saved_attn += out
        attn_bwd = qkv + band_grads  # dq, dk, dv (and the windows' gradients)
        if flash2_backward(run, on_cpu) and not banded:  # the band's masked blocks run the efficient kernel
            attn_bwd += 4 * T * heads * d  # FlashAttention-2's fp32 dq accumulator (flash-attn's or torch's)
            if kv < q_local:
                attn_bwd += 2 * a * T * heads * d  # dk, dv expanded to every query head
    if chunks > 1:
        seq_qkv = a * T * d * (heads + 2 * model.kv_heads)  # the sequence-sharded inputs, saved
        saved_attn += seq_qkv
        # One chunk's recompute and its gradients (the kernel's terms scale with its heads; its q/k/v as
        # `qkv_chunk`), next to the whole q/k/v gradient.
        attn_bwd = seq_qkv + (kernel_saved - qkv + attn_bwd - qkv) / chunks + 2 * qkv_chunk
    else:
        saved_attn += kernel_saved
    tiles = mlp_tiles(model, run, T)
    mlp_saved_factor = 3 if liger else 4
    saved_mlp = T * norm_bytes(h, a, liger)
    if tiles > 1:
        tile = ceil_div(T, tiles)
        mlp_fwd = a * tile * width * 3 + a * T * h
        mlp_bwd = a * tile * width * (mlp_saved_factor + (1 if liger else 2)) + a * T * h
    else:
        saved_mlp += a * T * width * mlp_saved_factor
        mlp_fwd = a * T * width * 3 if run.checkpointing else 0.0
        mlp_bwd = a * T * width * (1 if liger else 2)
    if model.experts:
        saved_mlp += 4 * T * model.experts  # router logits
    saved = saved_attn + saved_mlp
    forward = max(mlp_fwd, qkv_chunk if run.checkpointing or chunks > 1 else 0.0)
    # MLP backward runs with the whole layer saved; attention backward after the MLP's part is freed.
    backward = max(mlp_bwd, attn_bwd - saved_mlp, 0.0)
    all_to_all = qkv_chunk if sp > 1 else 0.0
    return LayerBytes(saved, saved_mlp, forward, backward, all_to_all, shared)


def loss_bytes(model: ModelShape, run: RunConfig, tokens: int, fused: bool) -> float:
    """Peak bytes of the LM head + cross-entropy on one rank.

    Untiled (transformers' loss): logits in the compute dtype, their fp32 upcast and the fp32
    log-probabilities in forward; in backward the log-probabilities, the NLL gradient and the
    gradient of the logits, all fp32: 12 bytes per logit. Fused (Liger's fused linear
    cross-entropy, `tiled_loss="liger"` or Liger kernels on; on GPUs the caller also uses this term for
    `tiled_loss=True`, which keeps the same two gradients, with a tile of `2**24 / V` tokens in place of
    Liger's chunk): the gradient of the hidden states, the LM head's gradient (+ one matmul temporary) and
    one chunk of `next_pow2(T / ceil(V / h))` tokens' logits. hf_longctx's tiled loss (CPU): gradients
    computed in forward and kept to backward, `[T, h]` for the hidden states and an fp32 `[V, h]` for
    the weight, and one tile of `2**24 / V` tokens' fp32 logits (+ their cast to the compute dtype).
    """
    a, h, v, T = run.act_bytes, model.hidden, model.vocab, tokens
    fused = fused or run.liger_kernels
    if fused:
        chunk = min(T, _next_pow2(ceil_div(T, ceil_div(v, h))))
        return a * T * h + 2 * a * v * h + a * chunk * v
    upcast = 4 if a < 4 else 0
    if not run.tiled_loss:
        return max(a + upcast + 4, 12) * T * v
    tile = run.loss_chunk_tokens or tile_tokens(v)
    return (4 + (a if a < 4 else 0)) * min(tile, T) * v + a * T * h + 4 * v * h


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())

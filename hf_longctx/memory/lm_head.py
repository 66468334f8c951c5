"""LM head + cross-entropy over token tiles: the `[tokens, vocab]` logits never exist at once.

Two autograd functions share one tile routine:

- `linear_cross_entropy_sum` (the Trainer loss): the summed token cross-entropy. Its gradient is
  computed tile by tile *inside* the forward (3 matmuls per tile, as Liger's fused linear
  cross-entropy does) and scaled by the incoming gradient in backward, so the LM head runs once.
- `linear_token_stats` (TRL's fused LM head outputs): per-token log-probability and entropy with
  gradients, plus the target-is-argmax flag and two no-grad statistics; backward recomputes each
  tile (the per-token incoming gradient is unknown in forward).

Both take the weight as a tensor. Under DeepSpeed ZeRO-3 the caller gathers it (`gathered`);
the recomputing backward gathers it again itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hf_longctx import _compat
from hf_longctx.data.sharding import IGNORE_INDEX
from hf_longctx.memory.tiling import TILE_LOGITS, tile_tokens  # noqa: F401 (TILE_LOGITS: re-exported)


@dataclass(frozen=True)
class LogitTransform:
    """What the model applies between `lm_head` and its logits: `z = cap * tanh(scale * raw / cap)`
    (no tanh when `softcap` is None), then `/ temperature` (TRL's fused head only)."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0

    def apply(self, raw: torch.Tensor) -> torch.Tensor:
        z = raw * self.scale if self.scale != 1.0 else raw
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z / self.temperature if self.temperature != 1.0 else z

    def derivative(self, z: torch.Tensor) -> torch.Tensor | float:
        """d z / d raw, given `z = apply(raw)`: a tensor like `z` with soft-capping, else a number."""
        factor = self.scale / self.temperature
        if self.softcap is None:
            return factor
        t = z * (self.temperature / self.softcap)  # tanh(scale * raw / cap)
        return (1 - t * t).mul_(factor)


def _tile_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: LogitTransform
) -> torch.Tensor:
    """`[n, vocab]` float32 logits of one tile, in the matmul dtype autocast would pick."""
    raw = torch.nn.functional.linear(hidden, weight, bias)
    return transform.apply(raw.float())


def _tiles(n_tokens: int, tile: int) -> Iterator[slice]:
    for start in range(0, n_tokens, tile):
        yield slice(start, min(start + tile, n_tokens))


@contextlib.contextmanager
def gathered(*params: torch.Tensor | None) -> Iterator[None]:
    """Gather DeepSpeed ZeRO-3 partitioned parameters for direct use (no-op otherwise).

    A ZeRO-3 parameter holds its full data only inside its module's forward; code that reads
    `lm_head.weight` directly must gather it, as DeepSpeed's own `GatheredParameters` does.
    """
    partitioned = [p for p in params if p is not None and getattr(p, "ds_status", None) is not None]
    if not partitioned:
        yield
        return
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    todo = list({id(p): p for p in partitioned if p.ds_status != ZeroParamStatus.AVAILABLE}.values())
    with deepspeed.zero.GatheredParameters(todo) if todo else contextlib.nullcontext():
        yield


def _matmul_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear` runs in for `t`: autocast's when it is on for `t`'s device, else `t`'s own."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else t.dtype


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`acc += a @ b`: the product of `a` and `b` in their own (matmul) dtype, summed in `acc`'s float32.

    On CUDA a bfloat16 / float16 product accumulates straight into float32 (`out_dtype`); elsewhere the
    operands, already rounded to the matmul dtype, are multiplied in float32, which gives the same products.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda and _compat.has_matmul_out_dtype():
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _add_head_grads(grad_z, dz_draw, h, weight, grad_h, grad_w, grad_b) -> None:
    """Chain a tile's logit gradient `grad_z` (in place) through the logit transform and the LM head into
    `grad_h` (this tile's rows, written: each row belongs to one tile), `grad_w` and `grad_b` (added; each
    None when not wanted). The two matmuls run in the dtype the logits' matmul ran in (the autocast dtype
    under autocast), as the untiled backward's do; `grad_h`'s is written in place when the dtypes agree (no
    `[tile, hidden]` temporary)."""
    grad_raw = grad_z if isinstance(dz_draw, float) and dz_draw == 1.0 else grad_z.mul_(dz_draw)
    mm = _matmul_dtype(h)
    if grad_h is not None:
        if grad_h.dtype == mm and grad_h.is_contiguous():
            torch.mm(grad_raw.to(mm), weight.to(mm), out=grad_h)
        else:
            grad_h.copy_(grad_raw.to(mm) @ weight.to(mm))
    if grad_w is not None:
        _add_matmul(grad_w, grad_raw.t().to(mm), h.to(mm))
    if grad_b is not None:
        grad_b += grad_raw.sum(0)


def _cross_entropy_tile(
    h: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
) -> torch.Tensor:
    """Summed cross-entropy of one tile; its gradients are written into `grad_h` (this tile's rows) and added to
    `grad_w` and `grad_b` (each None when not wanted). A function of its own so that the tile's
    `[tokens, vocab]` buffer is freed on return, before the next tile's is allocated."""
    z = _tile_logits(h, weight, bias, transform)  # [n, vocab]
    valid = y != IGNORE_INDEX
    target = y.clamp(min=0).unsqueeze(1)
    wants_grad = grad_h is not None or grad_w is not None or grad_b is not None
    dz_draw = transform.derivative(z) if wants_grad else 1.0
    # One pass of exp, in place: e = exp(z - max), lse = max + log(sum e), softmax = e / sum e.
    z_target = z.gather(1, target)
    peak = z.amax(dim=-1, keepdim=True)
    e = z.sub_(peak).exp_()
    sum_e = e.sum(dim=-1, keepdim=True)
    lse = peak + sum_e.log()
    total = torch.where(valid, (lse - z_target).squeeze(1), 0.0).sum()
    if not wants_grad:
        return total
    # d CE / d z = softmax(z) - onehot(y), zero on ignored tokens; computed in place.
    grad_raw = e.div_(sum_e)
    grad_raw.scatter_add_(1, target, torch.full(target.shape, -1.0, device=z.device))
    if not bool(valid.all()):
        grad_raw[~valid] = 0.0
    _add_head_grads(grad_raw, dz_draw, h, weight, grad_h, grad_w, grad_b)
    return total


class _LinearCrossEntropySum(torch.autograd.Function):
    """Sum of token cross-entropies of `transform(hidden @ weight.T + bias)`; gradients in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform, tile):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for part in _tiles(hidden.shape[0], tile):
            rows = grad_h[part] if grad_h is not None else None
            total += _cross_entropy_tile(hidden[part], labels[part], weight, bias, transform, rows, grad_w, grad_b)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = grad_total.float()
        out_h = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        out_w = (grad_w * scale).to(w_dtype) if grad_w is not None else None
        out_b = (grad_b * scale).to(b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    transform: LogitTransform = LogitTransform(),
    tile: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `transform(hidden @ weight.T + bias)` against `labels`, tiled.

    Args:
        hidden: `[n_tokens, hidden_size]` final hidden states (already aligned with `labels`).
        weight: `[vocab, hidden_size]` LM head weight (gathered, see `gathered`).
        bias: `[vocab]` or None.
        labels: `[n_tokens]` target ids; `IGNORE_INDEX` contributes nothing.
        transform: the model's logit scaling / soft-capping.
        tile: tokens per tile (default `tile_tokens(vocab)`).

    Returns:
        A float32 scalar; backward scales the gradients computed in forward by its incoming gradient.
    """
    tile = tile or tile_tokens(weight.shape[0])
    return _LinearCrossEntropySum.apply(hidden, weight, bias, labels, transform, tile)


class _Attach(torch.autograd.Function):
    """`x`, with a zero-gradient edge to `anchor` (see `attach`)."""

    @staticmethod
    def forward(ctx, x, anchor):
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


def attach(x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """`x` made to depend on `anchor` with a zero gradient.

    DeepSpeed ZeRO-3 gathers a module's parameters for backward when the backward reaches that
    module's *output*; a loss computed from `lm_head.weight` directly would return a full-size
    weight gradient while the weight is still partitioned. Anchoring the loss to the module's own
    (one-position) output makes the backward pass through it, so the weight is gathered in time.
    """
    return _Attach.apply(x, anchor) if anchor.requires_grad else x


STAT_NAMES = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _stats_tile(h, target, weight, bias, transform, log_probs, log_z, entropy, lssp, mean, top1) -> None:
    """One tile of `_LinearTokenStats.forward`, written into the output rows given (None = not wanted); a
    function of its own so that the tile's `[tokens, vocab]` buffers are freed before the next tile's."""
    z = _tile_logits(h, weight, bias, transform)
    if mean is not None:
        mean.copy_(z.mean(-1))
    if top1 is not None:
        top1.copy_(z.argmax(-1) == target)  # first maximum wins, like TRL's kernel
    peak = z.amax(dim=-1)
    e = (z - peak.unsqueeze(1)).exp_()  # the one exp pass: e = exp(z - max)
    sum_e = e.sum(-1)
    lse = peak + sum_e.log()
    log_z.copy_(lse)
    log_probs.copy_(z.gather(1, target.unsqueeze(1)).squeeze(1) - lse)
    if lssp is not None:
        # log sum p^2 = 2 log ||e|| - 2 log sum e (a norm: no tile-sized temporary, unlike e * e)
        lssp.copy_(2 * (torch.linalg.vector_norm(e, dim=-1).log() - sum_e.log()))
    entropy.copy_(lse - z.mul_(e).sum(-1) / sum_e)  # H = lse - sum p z; z is not needed after this


def _stats_grad_tile(h, target, weight, bias, transform, lse, entropy, g_lp, g_ent, grad_h, grad_w, grad_b) -> None:
    """One tile of `_LinearTokenStats.backward`: recompute the tile's logits, write its rows of `grad_h` and add
    its weight and bias gradients."""
    z = _tile_logits(h, weight, bias, transform)
    dz_draw = transform.derivative(z)
    lse = lse.unsqueeze(1)
    p = (z - lse).exp_()
    # d log p_y / d z_j = 1[j = y] - p_j;  d H / d z_j = -p_j (log p_j + H). Together, in place on z:
    # grad_z = -p * (g_lp + g_ent * (z - lse + H)), then + g_lp at the label.
    if g_ent is not None:
        grad_z = z.sub_(lse - entropy.unsqueeze(1)).mul_(g_ent.unsqueeze(1))
        if g_lp is not None:
            grad_z.add_(g_lp.unsqueeze(1))
    else:
        grad_z = z.copy_(g_lp.unsqueeze(1).expand_as(z))
    grad_z.mul_(p).neg_()
    if g_lp is not None:
        grad_z.scatter_add_(1, target.unsqueeze(1), g_lp.unsqueeze(1))
    _add_head_grads(grad_z, dz_draw, h, weight, grad_h, grad_w, grad_b)


class _LinearTokenStats(torch.autograd.Function):
    """Per-token log p(label), entropy (both differentiable), log sum p^2, mean logit, label is argmax."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform, tile, wanted):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        log_probs, log_z, entropy = torch.zeros(n, **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
        lssp = torch.zeros(n, **f32) if "log_sum_sq_probs" in wanted else None
        mean = torch.zeros(n, **f32) if "mean_logits" in wanted else None
        top1 = torch.zeros(n, dtype=torch.bool, device=hidden.device) if "is_top1" in wanted else None
        target = labels.clamp(min=0)
        for part in _tiles(n, tile):
            rows = [t[part] if t is not None else None for t in (log_probs, log_z, entropy, lssp, mean, top1)]
            _stats_tile(hidden[part], target[part], weight, bias, transform, *rows)
        ctx.save_for_backward(hidden, weight, bias, labels, log_z, entropy)
        ctx.transform, ctx.tile = transform, tile
        # Backward recomputes the logits: under forward's autocast (autograd does not carry it into backward,
        # and torch.amp.custom_bwd is tied to one device type), so they equal the ones `log_z` came from.
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        valid = labels != IGNORE_INDEX
        outs = [
            log_probs.masked_fill_(~valid, 0.0),
            entropy.masked_fill(~valid, 0.0),
            lssp.masked_fill_(~valid, 0.0) if lssp is not None else None,
            mean.masked_fill_(~valid, 0.0) if mean is not None else None,
            top1 & valid if top1 is not None else None,
        ]
        ctx.mark_non_differentiable(*(t for t in outs[2:] if t is not None))
        return tuple(outs)

    @staticmethod
    def backward(ctx, grad_lp, grad_ent, *_):
        if grad_lp is None and grad_ent is None:
            return (None,) * 7
        hidden, weight, bias, labels, log_z, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden, dtype=torch.float32) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        valid = labels != IGNORE_INDEX
        target = labels.clamp(min=0)
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled), gathered(weight, bias):
            for part in _tiles(hidden.shape[0], ctx.tile):
                g_lp = torch.where(valid[part], grad_lp[part].float(), 0.0) if grad_lp is not None else None
                g_ent = torch.where(valid[part], grad_ent[part].float(), 0.0) if grad_ent is not None else None
                rows = grad_h[part] if grad_h is not None else None
                _stats_grad_tile(
                    hidden[part],
                    target[part],
                    weight,
                    bias,
                    ctx.transform,
                    log_z[part],
                    entropy[part],
                    g_lp,
                    g_ent,
                    rows,
                    grad_w,
                    grad_b,
                )
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
        )


def linear_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    transform: LogitTransform = LogitTransform(),
    wanted: tuple[str, ...] = STAT_NAMES,
    tile: int | None = None,
) -> dict[str, torch.Tensor | None]:
    """Per-token statistics of `softmax(transform(hidden @ weight.T + bias))`, tiled (TRL's fused LM head).

    Args:
        hidden: `[n_tokens, hidden_size]`; labels: `[n_tokens]` (`IGNORE_INDEX` = not scored).
        weight, bias, transform, tile: as in `linear_cross_entropy_sum`.
        wanted: which of `STAT_NAMES` to return; log-probabilities and entropy are always computed.

    Returns:
        `{name: [n_tokens] tensor or None}` for every name in `STAT_NAMES`, zero (False) on ignored
        tokens. `log_probs` and `entropy` carry gradients (recomputed per tile in backward).
    """
    tile = tile or tile_tokens(weight.shape[0])
    outs = _LinearTokenStats.apply(hidden, weight, bias, labels, transform, tile, tuple(wanted))
    result = dict(zip(STAT_NAMES, outs, strict=True))
    return {k: (v if k in wanted or k == "log_probs" else None) for k, v in result.items()}

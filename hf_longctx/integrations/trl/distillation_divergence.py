"""Knowledge distillation's token divergence from two LM heads, in tiles: `linear_divergence_sum`.

TRL 1.16's `DistillationTrainer` compares the student's and the teacher's next-token distributions at every
completion position with a generalised Jensen-Shannon divergence (`beta` 0: forward KL(teacher || student),
1: reverse KL(student || teacher), between: the JSD with mixture `(1 - beta) p_student + beta p_teacher`), at a
temperature. This computes the summed divergence and the student's summed entropy from both models' final hidden
states and LM heads, `tile` tokens at a time over the whole vocabulary, so neither model's `[tokens, vocab]`
logits exist at once (what `tiled_loss` does for the student's cross-entropy, `hf_longctx/memory/lm_head.py`).
The loss is a plain sum, so its gradients (student hidden states, LM head weight and bias) are computed tile by
tile inside the forward and scaled by the incoming gradient in backward: the LM heads run once.
"""

from __future__ import annotations

import math

import torch

from hf_longctx.memory.lm_head import LogitTransform, _add_head_grads, _tile_logits, _tiles
from hf_longctx.memory.tiling import TILE_LOGITS, tile_tokens


def divergence_tile_tokens(vocab_size: int) -> int:
    """Tokens per tile: a quarter of `TILE_LOGITS` logits, since a divergence tile holds about six tile-sized
    float32 buffers (both models' log-probabilities and probabilities, the mixture, a gradient) where the
    cross-entropy tile holds one or two; the tiles then take about what `tiled_loss`'s do."""
    return tile_tokens(vocab_size, max(1, TILE_LOGITS // 4))


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`(a * b).sum(-1)` without an `[n, vocab]` temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def _divergence_tile(
    h_s: torch.Tensor,
    w_s: torch.Tensor,
    b_s: torch.Tensor | None,
    h_t: torch.Tensor,
    w_t: torch.Tensor,
    b_t: torch.Tensor | None,
    beta: float,
    t_s: LogitTransform,
    t_t: LogitTransform,
    grads: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's summed divergence and student entropy; with `grads` (this tile's rows of the hidden-state
    gradient, the weight and bias gradients) the tile's gradients are written / added there. A function of its
    own so the tile's `[tokens, vocab]` buffers are freed before the next tile's."""
    z_s = _tile_logits(h_s, w_s, b_s, t_s)  # [n, vocab] float32, tempered
    dz_draw = t_s.derivative(z_s) if grads is not None else 1.0
    with torch.no_grad():
        z_t = _tile_logits(h_t, w_t, b_t, t_t)
    log_s = z_s.sub_(torch.logsumexp(z_s, -1, keepdim=True))  # in place: the logits are not needed again
    log_t = z_t.sub_(torch.logsumexp(z_t, -1, keepdim=True))
    p_s = log_s.exp()
    entropy = -_rowdot(p_s, log_s)
    if beta == 0.0:  # KL(p_t || p_s); d / d z_s = p_s - p_t
        p_t = log_t.exp()
        divergence = _rowdot(p_t, log_t.sub_(log_s))
        grad_z = p_s.sub_(p_t)
    elif beta == 1.0:  # KL(p_s || p_t); d / d z_s = p_s (log p_s - log p_t - KL)
        gap = log_s.sub_(log_t)
        divergence = _rowdot(p_s, gap)
        grad_z = gap.sub_(divergence.unsqueeze(1)).mul_(p_s)
    else:  # beta KL(p_t || m) + (1 - beta) KL(p_s || m); d / d z_s = (1 - beta) p_s (log p_s - log m - KL(p_s || m))
        log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
        p_t = log_t.exp()
        kl_t = _rowdot(p_t, log_t.sub_(log_m))
        gap = log_s.sub_(log_m)
        kl_s = _rowdot(p_s, gap)
        divergence = beta * kl_t + (1 - beta) * kl_s
        grad_z = gap.sub_(kl_s.unsqueeze(1)).mul_(p_s).mul_(1 - beta)
    if grads is not None:
        _add_head_grads(grad_z, dz_draw, h_s, w_s, *grads)
    return divergence.sum(), entropy.sum()


class _LinearDivergenceSum(torch.autograd.Function):
    """Summed divergence (differentiable in the student's hidden states, weight, bias) and summed entropy."""

    @staticmethod
    def forward(ctx, h_s, w_s, b_s, h_t, w_t, b_t, beta, t_s, t_t, tile):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        want = need_h or need_w or need_b
        grad_h = torch.zeros_like(h_s) if need_h else None
        grad_w = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device) if need_w else None
        grad_b = torch.zeros(b_s.shape, dtype=torch.float32, device=b_s.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=h_s.device)
        entropy = torch.zeros((), dtype=torch.float32, device=h_s.device)
        for part in _tiles(h_s.shape[0], tile):
            rows = (grad_h[part] if grad_h is not None else None, grad_w, grad_b) if want else None
            div, ent = _divergence_tile(h_s[part], w_s, b_s, h_t[part], w_t, b_t, beta, t_s, t_t, rows)
            total += div
            entropy += ent
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (w_s.dtype, b_s.dtype if b_s is not None else None)
        ctx.mark_non_differentiable(entropy)
        return total, entropy

    @staticmethod
    def backward(ctx, grad_total, _):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        scale = grad_total.float()
        out_h = grad_h * scale.to(grad_h.dtype) if grad_h is not None else None
        out_w = (grad_w * scale).to(w_dtype) if grad_w is not None else None
        out_b = (grad_b * scale).to(b_dtype) if grad_b is not None else None
        return out_h, out_w, out_b, None, None, None, None, None, None, None


def linear_divergence_sum(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    student_bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    teacher_bias: torch.Tensor | None,
    beta: float,
    student_transform: LogitTransform | None = None,
    teacher_transform: LogitTransform | None = None,
    tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed generalised JSD and summed student entropy of `n` token positions, in tiles.

    Args:
        student_hidden: `[n, hidden_s]` student final hidden states, one row per scored position.
        student_weight, student_bias: the student's LM head (`[vocab, hidden_s]`, `[vocab]` or None), gathered.
        teacher_hidden: `[n, hidden_t]` teacher final hidden states at the same positions (no gradient).
        teacher_weight, teacher_bias: the teacher's LM head over the same vocabulary, gathered.
        beta: 0 forward KL, 1 reverse KL, else the generalised JSD (TRL's `DistillationConfig.beta`).
        student_transform, teacher_transform: each model's logit scaling / soft-capping, with the temperature
            (default: none, temperature 1).
        tile: tokens per tile (default `divergence_tile_tokens(vocab)`).

    Returns:
        `(divergence_sum, entropy_sum)`, float32 scalars; the entropy is of the tempered student distribution
        and carries no gradient.

    Raises:
        ValueError: the two heads have different vocabularies, or `beta` is outside [0, 1].
    """
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"The student's LM head has {student_weight.shape[0]} outputs and the teacher's {teacher_weight.shape[0]}: "
            "the divergence compares full next-token distributions, which needs one vocabulary."
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}.")
    tile = tile or divergence_tile_tokens(student_weight.shape[0])
    if not torch.is_grad_enabled():  # `needs_input_grad` ignores no_grad: nothing to compute gradients for
        student_hidden, student_weight = student_hidden.detach(), student_weight.detach()
        student_bias = student_bias.detach() if student_bias is not None else None
    return _LinearDivergenceSum.apply(
        student_hidden,
        student_weight,
        student_bias,
        teacher_hidden.detach(),
        teacher_weight.detach(),
        teacher_bias.detach() if teacher_bias is not None else None,
        float(beta),
        student_transform or LogitTransform(),
        teacher_transform or LogitTransform(),
        tile,
    )

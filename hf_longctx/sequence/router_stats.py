"""One forward's router statistics, per expert: top-k assignments, router probabilities, counted tokens.

`RouterStats.add` takes one router call's logits; `load_balancing_from_stats` is transformers'
`load_balancing_loss_func` written on those sums (the form that can be reduced over SP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _RouterSums(torch.autograd.Function):
    """(sum_t w_t softmax(logits_t), top-k assignment counts weighted by w): one layer's statistics.

    Only the logits are saved (the softmax is recomputed in backward), through `save_for_backward`: under
    activation checkpointing they are then dropped after the forward like the layer's other tensors and recreated
    when the layer is recomputed (`router_sums` is called again there: see `RouterLoss`), so they do not
    accumulate over the layers.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, weights: torch.Tensor, top_k: int):
        probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers' loss
        _, selected = torch.topk(probs, top_k, dim=-1)
        counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
        counts.scatter_add_(0, selected.reshape(-1), weights.repeat_interleave(top_k))
        ctx.save_for_backward(logits, weights)
        ctx.mark_non_differentiable(counts)
        return (probs.float() * weights.unsqueeze(-1)).sum(dim=0), counts

    @staticmethod
    def backward(ctx, grad_sums: torch.Tensor, grad_counts: torch.Tensor):
        logits, weights = ctx.saved_tensors
        probs = torch.softmax(logits, dim=-1).float()
        grad_probs = grad_sums.unsqueeze(0) * weights.unsqueeze(-1)
        grad = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
        return grad.to(logits.dtype), None, None


def router_sums(logits: torch.Tensor, weights: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(probability sums [E], assignment counts [E])` of one router call (`weights` `[tokens]` float32)."""
    return _RouterSums.apply(logits, weights, top_k)


@dataclass
class RouterStats:
    """Per-expert sums of one forward: assignments, router probabilities, and the counted tokens (all float32)."""

    counts: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def empty(cls, num_experts: int, device: torch.device) -> RouterStats:
        zeros = torch.zeros(num_experts, dtype=torch.float32, device=device)
        return cls(zeros, zeros.clone(), torch.zeros((), dtype=torch.float32, device=device))

    def add(self, logits: torch.Tensor, weights: torch.Tensor, top_k: int) -> None:
        """Add one router call: `logits` `[tokens, E]`, `weights` `[tokens]` (1 a counted token, 0 padding)."""
        probs, counts = router_sums(logits, weights, top_k)
        self.counts = self.counts + counts
        self.probs = self.probs + probs
        self.rows = self.rows + weights.sum().to(self.rows.device)


def load_balancing_from_stats(counts: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` from the summed statistics: `E * sum(counts/N * probs/N)`."""
    return counts.numel() * (counts / rows * (probs / rows)).sum()

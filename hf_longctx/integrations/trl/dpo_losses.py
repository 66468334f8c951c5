"""DPO's per-pair losses (TRL 1.16's `loss_type`s and f-divergences) from whole-sequence per-row values.

Every TRL DPO loss is a function of per-row quantities: the summed completion log-probs of policy and
reference, the completion token counts, and (for `sft`) the chosen rows' summed log-probs and scored
tokens. Under SP `dpo.py` reduces those over the SP group first; given the same values, the formulas
below give what TRL computes without SP (the SP tests compare against TRL's own code).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


@dataclass
class Pairs:
    """A DP rank's pairs, every tensor `[B]` and the same on every SP rank."""

    chosen: torch.Tensor  # policy log-probs of the chosen completions
    rejected: torch.Tensor
    ref_chosen: torch.Tensor  # reference log-probs
    ref_rejected: torch.Tensor
    chosen_tokens: torch.Tensor  # completion tokens (TRL's `completion_mask.sum(1)`)
    rejected_tokens: torch.Tensor
    chosen_scored: torch.Tensor  # scored completion tokens (the shifted mask: every completion token but a first one)


def f_scores(ratio: torch.Tensor, kind: str, alpha: float) -> torch.Tensor:
    """f'(policy / reference) of the f-divergence `kind` (f-DPO), from the log-ratio."""
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return ratio
    if kind == "forward_kl":
        return 1 - torch.exp(-ratio)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(ratio)
    if kind == "alpha_divergence":
        t = (alpha - 1.0) * ratio
        cap = 11.0 if t.dtype == torch.float16 else 80.0  # exp stays finite once cast back
        return (torch.exp(t.float().clamp(max=cap)) - 1.0).to(t.dtype) * (1.0 / (alpha - 1.0))
    raise ValueError(f"Unknown f_divergence_type {kind!r}; expected one of {F_DIVERGENCES}.")


def pair_losses(
    p: Pairs, beta: float, eps: float, tau: float, kind: str, alpha: float
) -> dict[str, Callable[[], torch.Tensor]]:
    """`loss_type` -> the `[B]` per-pair loss (computed when called).

    Args:
        p: the pairs' whole-sequence values.
        beta, eps, tau: TRL's `beta`, `label_smoothing`, `discopop_tau`.
        kind, alpha: `f_divergence_type` and `f_alpha_divergence_coef`.
    """
    chosen_ratio, rejected_ratio = p.chosen - p.ref_chosen, p.rejected - p.ref_rejected
    chosen_score, rejected_score = f_scores(chosen_ratio, kind, alpha), f_scores(rejected_ratio, kind, alpha)
    z = beta * (chosen_score - rejected_score)
    per_token = chosen_score / p.chosen_tokens.clamp(min=1) - rejected_score / p.rejected_tokens.clamp(min=1)
    cr, rr = beta * chosen_ratio, beta * rejected_ratio
    sig, logsig = torch.sigmoid, F.logsigmoid

    def smoothed(delta: torch.Tensor) -> torch.Tensor:
        return -logsig(beta * delta) * (1 - eps) - logsig(-beta * delta) * eps

    def exo() -> torch.Tensor:
        # KL between softmax(z, -z) and the (1 - eps, eps) target over {chosen, rejected}.
        target = torch.tensor(eps, device=z.device)
        return sig(z) * (logsig(z) - torch.log1p(-target)) + sig(-z) * (logsig(-z) - torch.log(target))

    def discopop() -> torch.Tensor:
        mix = sig(z / tau)
        return -logsig(z) * (1 - mix) + torch.exp(-z) * mix

    def sft() -> torch.Tensor:
        # The chosen completions' token-mean negative log-likelihood, the same for every pair.
        return (-p.chosen.sum() / p.chosen_scored.sum()).expand(p.chosen.shape[0])

    return {
        "sigmoid": lambda: -logsig(z),
        "hinge": lambda: torch.relu(1 - z),
        "ipo": lambda: (per_token - 1 / (2 * beta)) ** 2,
        "sigmoid_norm": lambda: -logsig(beta * per_token),
        "robust": lambda: (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps),
        "exo_pair": exo,
        "nca_pair": lambda: -logsig(cr) - 0.5 * logsig(-cr) - 0.5 * logsig(-rr),
        "bco_pair": lambda: -logsig(cr) - logsig(-rr),
        "sppo_hard": lambda: (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2,
        "aot": lambda: smoothed(
            torch.sort(p.chosen - p.rejected, dim=0)[0] - torch.sort(p.ref_chosen - p.ref_rejected, dim=0)[0]
        ),
        "aot_unpaired": lambda: smoothed(torch.sort(chosen_ratio, dim=0)[0] - torch.sort(rejected_ratio, dim=0)[0]),
        "apo_zero": lambda: 1 - sig(cr) + sig(rr),
        "apo_down": lambda: sig(cr) + 1 - sig(cr - rr),
        "discopop": discopop,
        "sft": sft,
    }


LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "sigmoid_norm",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
)

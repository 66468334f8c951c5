"""KTO's per-row losses (TRL 1.16's `loss_type`s) from whole-sequence per-row values.

TRL 1.16's KTO loss is a function of per-row quantities only: the summed completion log-probs of policy and
reference, each row's desirable / undesirable label, and (for `kto`) one KL estimate per step, the mean of
policy - reference log-probs of mismatched prompt / completion pairs over every process. Under SP `kto.py`
reduces the log-prob sums over the SP group and the KL mean over the DP ranks first; given the same values, the
formulas below give what TRL computes without SP (the SP tests compare against TRL's own code).
"""

from __future__ import annotations

import torch

LOSS_TYPES = ("kto", "apo_zero_unpaired")
# The loss types that estimate the KL term (TRL: every one but `apo_zero_unpaired`), as TRL's `calculate_KL`.
KL_LOSS_TYPES = ("kto",)


def unpaired_losses(
    chosen_ratios: torch.Tensor,
    rejected_ratios: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    loss_type: str,
    weights: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """The weighted per-row losses, desirable rows first (the order whose `nanmean` TRL takes as the loss).

    Args:
        chosen_ratios, rejected_ratios: policy - reference log-probs of the desirable / undesirable rows.
        kl: the step's KL estimate (0-d; unused by `apo_zero_unpaired`).
        beta: TRL's `beta`.
        loss_type: one of `LOSS_TYPES`.
        weights: TRL's (`desirable_weight`, `undesirable_weight`).

    Raises:
        ValueError: an unknown `loss_type`.
    """
    sig = torch.sigmoid
    if loss_type == "kto":  # KTO paper eq. 7: a value relative to the KL reference point
        chosen, rejected = 1 - sig(beta * (chosen_ratios - kl)), 1 - sig(beta * (kl - rejected_ratios))
    elif loss_type == "apo_zero_unpaired":  # APO-zero, unpaired: push desirable up and undesirable down
        chosen, rejected = 1 - sig(beta * chosen_ratios), sig(beta * rejected_ratios)
    else:
        raise ValueError(f"Unknown KTO loss_type {loss_type!r}; expected one of {LOSS_TYPES}.")
    return torch.cat((weights[0] * chosen, weights[1] * rejected), 0)

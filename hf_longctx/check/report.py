"""The report side of `hf-longctx check`: SP run vs SP=1 reference, worst parameters, verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hf_longctx.check.model import StepResult

TOP_K = 5
# A reference gradient below this fraction of the largest one is zero in exact arithmetic (e.g. a bias on
# the keys, which softmax ignores) and holds only round-off; it has no scale of its own, so its error is
# measured against the largest gradient instead.
ZERO_GRAD_RTOL = 1e-6


@dataclass
class Comparison:
    """SP run vs SP=1 reference."""

    loss_sp: float
    loss_ref: float
    loss_rel: float
    grad_errors: list[tuple[str, float]]  # (parameter, max|g_sp - g_ref| / max|g_ref|), worst first
    zero_grads: list[str]  # parameters compared against the largest gradient (see ZERO_GRAD_RTOL)

    @property
    def worst_grad(self) -> float:
        """The largest relative gradient error (0 when the model has no parameters)."""
        return self.grad_errors[0][1] if self.grad_errors else 0.0


def compare(sp_loss: float, sp_grads: Mapping[str, torch.Tensor], ref: StepResult) -> Comparison:
    """Relative loss difference and per-parameter `max|g_sp - g_ref| / max|g_ref|`, worst first (a
    numerically zero reference gradient against the largest one, see `ZERO_GRAD_RTOL`).

    Raises:
        ValueError: the two runs do not have the same parameter names and shapes.
    """
    if sp_grads.keys() != ref.grads.keys():
        raise ValueError(f"SP and reference parameters differ: {sorted(set(sp_grads) ^ set(ref.grads))[:5]}")
    scales = {name: float(r.double().abs().max()) if r.numel() else 0.0 for name, r in ref.grads.items()}
    largest = max(scales.values(), default=0.0)
    errors, zero = [], []
    for name, r in ref.grads.items():
        g = sp_grads[name]
        if g.shape != r.shape:
            raise ValueError(f"{name}: SP gradient {tuple(g.shape)} vs reference {tuple(r.shape)}")
        diff = float((g.double() - r.double()).abs().max()) if r.numel() else 0.0
        scale = scales[name]
        if r.numel() and scale < ZERO_GRAD_RTOL * largest and (scale > 0 or diff > 0):  # not an unused one
            zero.append(name)
            scale = largest
        if math.isnan(diff):
            err = math.inf
        else:
            err = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        errors.append((name, err))
    errors.sort(key=lambda item: item[1], reverse=True)
    denom = abs(ref.loss) if ref.loss != 0 else 1.0
    loss_rel = abs(sp_loss - ref.loss) / denom
    if not math.isfinite(sp_loss):
        loss_rel = math.inf
    return Comparison(sp_loss, ref.loss, loss_rel, errors, zero)


def verdict(cmp: Comparison, sp: int, tol_loss: float, tol_grad: float, label: str) -> tuple[bool, str]:
    """`(passed, line)`: the final "PASS: ..." or "FAIL: <reason>" line of the report."""
    problems = []
    if not cmp.loss_rel <= tol_loss:
        problems.append(f"loss relative difference {cmp.loss_rel:.2e} > {tol_loss:.0e}")
    if not cmp.worst_grad <= tol_grad:
        bad = [name for name, err in cmp.grad_errors if not err <= tol_grad]
        problems.append(
            f"{len(bad)} of {len(cmp.grad_errors)} gradients differ by more than {tol_grad:.0e} "
            f"(worst {cmp.worst_grad:.2e}: {', '.join(bad[:3])})"
        )
    if problems:
        return False, f"FAIL: SP={sp} is not exact for {label}: " + "; ".join(problems)
    return True, (
        f"PASS: SP={sp} matches SP=1 for {label} (loss rel {cmp.loss_rel:.1e} <= {tol_loss:.0e}, "
        f"grads rel {cmp.worst_grad:.1e} <= {tol_grad:.0e} over {len(cmp.grad_errors)} parameters)"
    )

"""Compare and plot the loss curves of finished Trainer runs (their `trainer_state.json`).

`compare_runs(run_dir, reference_dir)` is the main entry: the per-step relative loss difference
of two runs that logged the same steps, which is how the main job proves SP=2 equals SP=1.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping


def loss_curve(output_dir: str) -> dict[int, float]:
    """Training loss per logged step, read from `output_dir/trainer_state.json`.

    Raises:
        ValueError: no trainer state in `output_dir`.
    """
    path = os.path.join(output_dir, "trainer_state.json")
    if not os.path.exists(path):
        raise ValueError(f"{path} not found: run the training first (it calls trainer.save_state()).")
    with open(path) as f:
        history = json.load(f)["log_history"]
    return {h["step"]: float(h["loss"]) for h in history if "loss" in h and "step" in h}


def compare_runs(run_dir: str, reference_dir: str) -> tuple[float, int]:
    """Largest relative loss difference over the steps both runs logged, and how many steps that is.

    Raises:
        ValueError: the runs share no logged step.
    """
    run, ref = loss_curve(run_dir), loss_curve(reference_dir)
    steps = sorted(set(run) & set(ref))
    if not steps:
        raise ValueError(f"{run_dir} and {reference_dir} have no logged step in common.")
    return max(abs(run[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in steps), len(steps)


def plot_loss_curves(runs: Mapping[str, str], path: str) -> str:
    """Plot the loss curves of `runs` (label -> output dir; the first is the one compared, the last the
    reference) and, below, the per-step relative difference of the first to the last, whose maximum is in
    the title: curves that agree to 1e-7 look identical, so the difference gets its own log-scale panel.

    Returns:
        `path` (a PNG).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, diff_ax) = plt.subplots(2, 1, figsize=(6, 5.5), sharex=True, height_ratios=(2, 1))
    curves = {label: loss_curve(output_dir) for label, output_dir in runs.items()}
    for i, (label, curve) in enumerate(curves.items()):
        ax.plot(
            list(curve),
            list(curve.values()),
            marker="o" if i == 0 else "x",
            linestyle="-" if i == 0 else "--",
            label=label,
        )
    ax.set_ylabel("training loss")
    ax.legend()
    run, ref = list(curves.values())[0], list(curves.values())[-1]
    steps = sorted(set(run) & set(ref))
    rel = [abs(run[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in steps]
    first, last = list(curves)[0], list(curves)[-1]
    # An exactly equal step has no place on a log axis: draw it at the float32 round-off floor.
    diff_ax.semilogy(steps, [max(r, 1e-9) for r in rel], marker="o")
    diff_ax.set_xlabel("optimizer step")
    diff_ax.set_ylabel("relative difference\n(0 drawn at 1e-9)")
    title = f"hf_longctx: {first} vs {last}" + (f", max relative difference {max(rel):.1e}" if rel else "")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

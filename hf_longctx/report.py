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
    """Plot every run's loss curve (label -> output dir) into one PNG at `path`; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, output_dir) in enumerate(runs.items()):
        curve = loss_curve(output_dir)
        ax.plot(
            list(curve),
            list(curve.values()),
            marker="o" if i == 0 else "x",
            linestyle="-" if i == 0 else "--",
            label=label,
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title("hf_longctx: loss curves")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

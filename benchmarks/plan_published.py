"""Published long-sequence memory results vs `hf-longctx plan`: fits / OOM and peak GiB.

    python -m benchmarks.plan_published          # the comparison table quoted in docs/planner.md

`POINTS` is data with a source, not output of the planner: each entry is a configuration someone ran
(or that ran out of memory) and what they reported. Sources:

- HF: "Ulysses Sequence Parallelism: Training with Million-Token Contexts", Hugging Face blog,
  2026-03-09, https://huggingface.co/blog/ulysses-sp, section "Benchmarks": Qwen3-4B, H100 80GB,
  TRL SFTTrainer, DeepSpeed ZeRO-3, gradient checkpointing, flash-attention 2, micro-batch 1; peak
  memory per rank at SP=4 for 8K-96K, "At 128K, the model requires ~81 GB and OOMs"; the 1-GPU 8K
  baseline at 76.4 GB.
- ALST: S. Bekman et al., "Arctic Long Sequence Training: Scalable And Efficient Training For
  Multi-Million Token Sequences", arXiv:2506.13996 (2025): Llama-3.1-8B, 32K baseline; 500K on 1 H100,
  3.7M on 8, 8M on 16 ("close to OOM"), 15M on 32; 65K baseline and 1.2M on one H200; feature ablation
  on 8 H100s. The exact setup of each run is the paper's published recipe in ArcticTraining,
  https://github.com/snowflakedb/ArcticTraining/tree/main/projects/sequence-parallelism
  (`run-h100-sp*-llama-8b*.yml`, `run-h200-sp1-llama-8b-*.yml`, `run-sp8-llama-8b-*.yml`): ZeRO-3 with
  CPU optimizer offload (and parameter offload on one GPU), activation checkpointing (ArcticTraining's
  default), micro-batch 1, flash-attention 2 (H100) / 3 (H200), Liger kernels (RMSNorm, SwiGLU, RoPE,
  fused linear cross-entropy) for the ALST runs, TiledMLP and activation-checkpoint CPU offload where
  named. Memory figures are the recipes' comments (GiB, as DeepSpeed's `see_memory_usage` prints them).

How a maximum is read: a reported maximum sequence length is a "fits" point, and 1.5x that length an
"OOM" point (the sources give no step size for their search; see docs/planner.md for each point's
predicted/published maximum ratio). Units: the sources write "GB" for 2^30 bytes; we read them as GiB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hf_longctx.planner import DEVICES, RunConfig, estimate, max_seq_len
from hf_longctx.planner.model_shape import load_model_shape

HF = "HF Ulysses blog"
ALST = "ALST (arXiv:2506.13996)"
OOM_FACTOR = 1.5

_HF_SP4 = {"world": 4, "sp": 4, "engine": "zero3", "gradient_checkpointing": True}
_HF_1GPU = {"engine": "zero3", "gradient_checkpointing": True}
_ALST_FEATURES = {"liger_kernels": True, "tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
_LIGER, _OFFLOAD = {"liger_kernels": True}, {"offload_activations": True}
L8B = "llama3.1-8b"


def _alst(world: int = 1, sp: int = 1, **features: bool) -> dict[str, Any]:
    """ALST's recipe at `world` GPUs (`sp` of them one SP group) with the given features on."""
    run = {"world": world, "sp": sp, "engine": "zero3", "offload_optimizer": True, "gradient_checkpointing": True}
    if world == 1:
        run["offload_params"] = True
    return {**run, **features}


@dataclass(frozen=True)
class PublishedPoint:
    """One published configuration: what was run and what the source reports."""

    source: str
    label: str
    model: str
    gpu: str
    seq_len: int
    run: dict[str, Any] = field(hash=False)
    fits: bool
    gib: float | None = None
    basis: str = "reported"


def _max_pair(source: str, label: str, model: str, gpu: str, seq: int, run: dict, gib: float | None = None):
    """A reported maximum: fits at `seq`, OOM at OOM_FACTOR x `seq`."""
    return [
        PublishedPoint(source, label, model, gpu, seq, run, True, gib, "reported maximum"),
        PublishedPoint(source, label, model, gpu, int(seq * OOM_FACTOR), run, False, None, f"{OOM_FACTOR}x maximum"),
    ]


POINTS: list[PublishedPoint] = [
    PublishedPoint(HF, "4xH100 SP=4 ZeRO-3", "qwen3-4b", "h100", 8192, _HF_SP4, True, 23.4),
    PublishedPoint(HF, "4xH100 SP=4 ZeRO-3", "qwen3-4b", "h100", 32768, _HF_SP4, True, 35.0),
    PublishedPoint(HF, "4xH100 SP=4 ZeRO-3", "qwen3-4b", "h100", 65536, _HF_SP4, True, 50.5),
    PublishedPoint(HF, "4xH100 SP=4 ZeRO-3", "qwen3-4b", "h100", 98304, _HF_SP4, True, 66.0),
    PublishedPoint(HF, "4xH100 SP=4 ZeRO-3", "qwen3-4b", "h100", 131072, _HF_SP4, False, None, "reported OOM"),
    PublishedPoint(HF, "1xH100 baseline ZeRO-3", "qwen3-4b", "h100", 8192, _HF_1GPU, True, 76.4),
    # ALST baselines (no Liger, no tiling, no offloaded activations).
    PublishedPoint(ALST, "1xH100 baseline", L8B, "h100", 32000, _alst(), True, 71.91),
    *_max_pair(ALST, "1xH100 baseline", L8B, "h100", 36000, _alst()),
    *_max_pair(ALST, "8xH100 baseline (DP=8)", L8B, "h100", 32000, _alst(8)),
    *_max_pair(ALST, "32xH100 baseline (DP=32)", L8B, "h100", 36000, _alst(32)),
    # ALST with every feature.
    *_max_pair(ALST, "1xH100 ALST", L8B, "h100", 500_000, _alst(**_ALST_FEATURES)),
    *_max_pair(ALST, "8xH100 ALST SP=8", L8B, "h100", 3_700_000, _alst(8, 8, **_ALST_FEATURES)),
    *_max_pair(ALST, "16xH100 ALST SP=16", L8B, "h100", 8_000_000, _alst(16, 16, **_ALST_FEATURES)),
    *_max_pair(ALST, "32xH100 ALST SP=32", L8B, "h100", 15_000_000, _alst(32, 32, **_ALST_FEATURES)),
    # ALST on one H200: baseline, Liger, + activation offload, + tiled MLP.
    *_max_pair(ALST, "1xH200 baseline", L8B, "h200", 65_000, _alst(), 137.36),
    *_max_pair(ALST, "1xH200 Liger", L8B, "h200", 300_000, _alst(**_LIGER), 134.96),
    *_max_pair(ALST, "1xH200 Liger + act. offload", L8B, "h200", 650_000, _alst(**_LIGER, **_OFFLOAD), 126.81),
    *_max_pair(ALST, "1xH200 ALST", L8B, "h200", 1_200_000, _alst(**_ALST_FEATURES), 136.15),
    # ALST feature ablation on 8xH100.
    *_max_pair(ALST, "8xH100 DP=8 + Liger", L8B, "h100", 160_000, _alst(8, **_LIGER)),
    *_max_pair(ALST, "8xH100 SP=8 + Liger", L8B, "h100", 1_100_000, _alst(8, 8, **_LIGER)),
    *_max_pair(ALST, "8xH100 SP=8 + Liger + tiled MLP", L8B, "h100", 1_200_000, _alst(8, 8, **_LIGER, tiled_mlp=True)),
    *_max_pair(ALST, "8xH100 SP=8 + Liger + act. offload", L8B, "h100", 2_400_000, _alst(8, 8, **_LIGER, **_OFFLOAD)),
]


def evaluate(point: PublishedPoint) -> dict[str, Any]:
    """The planner's verdict on a point: peak GiB, fits, and the longest sequence for that setup."""
    model, device = load_model_shape(point.model), DEVICES[point.gpu]
    run = RunConfig(seq_len=point.seq_len, **point.run)
    plan = estimate(model, run, device)
    return {
        "predicted_gib": plan.peak_gib,
        "predicted_fits": plan.fits,
        "correct": plan.fits == point.fits,
        "gib_error": None if point.gib is None else plan.peak_gib / point.gib - 1,
        "max_seq": max_seq_len(model, run, device),
        "dominant": plan.dominant,
    }


def markdown() -> str:
    """The table quoted in docs/planner.md."""
    lines = [
        "| source | setup | S | published | predicted | published GiB | predicted GiB | predicted max S |",
        "| --- | --- | ---: | --- | --- | ---: | ---: | ---: |",
    ]
    right = 0
    for point in POINTS:
        result = evaluate(point)
        right += result["correct"]
        published = ("fits" if point.fits else "OOM") + f" ({point.basis})"
        predicted = ("fits" if result["predicted_fits"] else "OOM") + ("" if result["correct"] else " **(wrong)**")
        gib = "" if point.gib is None else f"{point.gib:.2f}"
        error = "" if point.gib is None else f" ({100 * result['gib_error']:+.1f}%)"
        lines.append(
            f"| {point.source} | {point.label} | {point.seq_len:,} | {published} | {predicted} | {gib} | "
            f"{result['predicted_gib']:.2f}{error} | {result['max_seq']:,} |"
        )
    lines.append("")
    lines.append(f"{right} of {len(POINTS)} fits/OOM points right ({100 * right / len(POINTS):.0f}%).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown())

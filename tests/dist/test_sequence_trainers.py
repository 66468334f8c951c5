"""Whole-sequence computations through the stock `Trainer` and TRL's `SFTTrainer`: exact at SP=2 and SP=4.

Per-step loss and grad_norm (and SFTTrainer's logged `aux_loss`, entropy, token accuracy) within 1e-5 of the same
run without SP (SGD, no clipping, 3+ steps), for a Qwen3-MoE with its router loss on (coefficient 0.3), with
gradient accumulation, gradient checkpointing, packed rows, DDP (DP=2 x SP=2 against DP=2) and DeepSpeed ZeRO-3; for
a Llama with dynamic-NTK RoPE on rows longer than its 32 native positions; for a Llama 4 whose no-RoPE layer scales
its queries by their index in the row (attention temperature, floor_scale 4). NEFTune's noise keeps the magnitude
`alpha / sqrt(length * hidden)` of the whole row. On f1bc042 the MoE loss is off by the router loss's share (1.4% at
SP=2) and NEFTune's noise is sqrt(2) too large.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.dist import _sft_utils as SU
from tests.dist import _trainer_utils as U

RTOL = 1e-5
MOE = "moe:qwen3_moe"
TRAINER = {
    "moe": {"model_kind": MOE, "steps": 3},
    "moe_ga2": {"model_kind": MOE, "steps": 3, "ga": 2},
    # Checkpointed layers recompute their routers in backward: the router statistics replay there.
    "moe_checkpointing": {"model_kind": MOE, "steps": 3, "gradient_checkpointing": True},
    "dynamic": {"model_kind": "dynamic", "steps": 3},
    "temperature": {"model_kind": "temperature", "steps": 3},  # Llama 4: temperature from floor_scale 4 on
}
SFT = {
    "moe": {"model_kind": MOE, "steps": 3},
    # Packed rows: the reference keeps documents apart with hf_longctx's attention on one rank (see run_sft).
    "moe_pack": {"model_kind": MOE, "steps": 3, "packing": True, "data": ("plain", 24)},
    "dynamic_pack": {"model_kind": "dynamic", "steps": 3, "packing": True, "data": ("plain", 24)},
}  # (TRL 1.16's fused LM head cannot run Llama4ForCausalLM, SP or not: its backbone returns the causal-LM output)
NEFTUNE_ALPHA = 5.0
DDP = ("moe", "temperature")  # DP=2 x SP=2 against DP=2


def _neftune(out_dir: str, sp: int) -> list[float]:
    """Train the tiny llama with NEFTune for 3 steps; per step, the largest noise over the magnitude bound."""
    import torch
    from transformers import Trainer, TrainingArguments

    from tests._models import tiny_model

    model = tiny_model("llama")
    clean: list[torch.Tensor] = []
    ratios: list[float] = []
    collator = U.RecordingCollator()
    # Registered before train(): runs before the NEFTune hook the Trainer adds, so it sees the clean embeddings.
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: clean.append(out.detach()))

    def noisy(module, args, kwargs):
        noise = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).detach() - clean.pop()
        # The i-th forward runs the i-th collated batch (the loader collates one batch ahead).
        length, hidden = collator.lengths[len(ratios)], noise.shape[-1]
        ratios.append(float(noise.abs().max() / (NEFTUNE_ALPHA / (length * hidden) ** 0.5)))

    model.model.layers[0].register_forward_pre_hook(noisy, with_kwargs=True)
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=U.BATCH,
        max_steps=3,
        optim="sgd",
        learning_rate=0.1,
        save_strategy="no",
        remove_unused_columns=False,
        neftune_noise_alpha=NEFTUNE_ALPHA,
        parallelism_config=U.parallelism_config(sp),
    )
    Trainer(model=model, args=args, train_dataset=U.dataset("mixed", 12), data_collator=collator).train()
    return ratios


def _worker(rank: int, world_size: int, out_dir: str, plan: dict[str, Any]) -> dict[str, Any]:
    results = {}
    for name, config in plan.get("trainer", {}).items():
        results[f"trainer/{name}"] = U.run_trainer(os.path.join(out_dir, "trainer", name), **config)
    for name, config in plan.get("sft", {}).items():
        results[f"sft/{name}"] = SU.run_sft(os.path.join(out_dir, "sft", name), **config)
    if plan.get("neftune"):
        results["neftune"] = _neftune(os.path.join(out_dir, "neftune"), world_size)
    return results


PLANS = {
    "ref": (
        1,
        {
            "trainer": TRAINER,
            "sft": {k: {**c, "doc_exact": c.get("packing", False)} for k, c in SFT.items()},
            "neftune": True,  # transformers' own hook: the bound holds without SP
        },
    ),
    "sp2": (
        2,
        {
            # ddp_*: plain DDP over the 2 ranks, the references of DP=2 x SP=2. (Not dynamic RoPE: DDP broadcasts
            # buffers, and dynamic RoPE re-registers its own from each rank's batch: a gloo size mismatch at the
            # third step of plain DDP already, without hf_longctx.)
            "trainer": {
                **{k: {**c, "sp": 2} for k, c in TRAINER.items()},
                **{f"ddp_{k}": TRAINER[k] for k in DDP},
            },
            "sft": {k: {**c, "sp": 2} for k, c in SFT.items()},
            "neftune": True,
        },
    ),
    "sp4": (
        4,
        {
            "trainer": {
                **{k: {**TRAINER[k], "sp": 4} for k in ("moe", "dynamic", "temperature")},
                **{f"dpsp_{k}": {**TRAINER[k], "sp": 2} for k in DDP},
            },
            "sft": {k: {**SFT[k], "sp": 4} for k in ("moe", "dynamic_pack")},
            "neftune": True,
        },
    ),
    # DeepSpeed ZeRO-3, SP=2: one engine per process (a second ZeRO-3 trainer in the same process trains differently
    # from its run alone: DeepSpeed keeps process-wide state).
    **{
        f"zero3_{k}": (2, {"trainer": {k: {**TRAINER[k], "sp": 2, "zero": 3}}})
        for k in ("moe", "dynamic", "temperature")
    },
    "zero3_sft": (2, {"sft": {"moe": {**SFT["moe"], "sp": 2, "zero": 3}}}),
}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("sequence_trainers")


def _plan(name: str, out_root) -> list[dict[str, Any]]:
    world, plan = PLANS[name]
    return U.spawn_once(("sequence", name), _worker, world, str(out_root / name), plan, timeout=600)


def _match(got: dict, want: dict, keys: tuple[str, ...]) -> None:
    U.compare_logs(got["logs"], want["logs"], keys, RTOL)


@pytest.mark.parametrize("name", list(TRAINER))
def test_trainer_sp2(name, out_root):
    want = _plan("ref", out_root)[0][f"trainer/{name}"]
    for rank in _plan("sp2", out_root):
        _match(rank[f"trainer/{name}"], want, ("loss", "grad_norm"))


@pytest.mark.parametrize("name", list(SFT))
def test_sft_sp2(name, out_root):
    want = _plan("ref", out_root)[0][f"sft/{name}"]
    assert ("aux_loss" in want["logs"][0]) == name.startswith("moe")
    for rank in _plan("sp2", out_root):
        _match(rank[f"sft/{name}"], want, SU.SFT_KEYS)


@pytest.mark.slow
def test_sp4_and_dp2_x_sp2(out_root):
    ref, ddp = _plan("ref", out_root)[0], _plan("sp2", out_root)[0]
    for rank in _plan("sp4", out_root):
        for name in ("moe", "dynamic", "temperature"):
            _match(rank[f"trainer/{name}"], ref[f"trainer/{name}"], ("loss", "grad_norm"))
        for name in DDP:
            _match(rank[f"trainer/dpsp_{name}"], ddp[f"trainer/ddp_{name}"], ("loss", "grad_norm"))
        for name in ("moe", "dynamic_pack"):
            _match(rank[f"sft/{name}"], ref[f"sft/{name}"], SU.SFT_KEYS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plan", "key", "keys"),
    [(f"zero3_{name}", f"trainer/{name}", ("loss", "grad_norm")) for name in ("moe", "dynamic", "temperature")]
    + [("zero3_sft", "sft/moe", SU.SFT_KEYS)],
)
def test_zero3_sp2(plan, key, keys, out_root):
    want = _plan("ref", out_root)[0][key]
    for rank in _plan(plan, out_root):
        _match(rank[key], want, keys)


def _check_neftune(results: list[list[float]]) -> None:
    """Uniform noise in [-m, m]: its largest value over thousands of draws is within a few per cent of m."""
    for ratios in results:
        assert len(ratios) == 3 and all(0.95 <= ratio <= 1.0 + 1e-5 for ratio in ratios), ratios


def test_neftune_noise_scale_is_the_whole_rows(out_root):
    _check_neftune([_plan("ref", out_root)[0]["neftune"], *[r["neftune"] for r in _plan("sp2", out_root)]])


@pytest.mark.slow
def test_neftune_noise_scale_sp4(out_root):
    _check_neftune([r["neftune"] for r in _plan("sp4", out_root)])

"""LoRA adapters under hf_longctx SP are exact: SP=2 against one process without SP, per step.

`get_peft_model(model, LoraConfig(...))` handed to the stock `Trainer`, and `SFTTrainer` given either the PEFT
model or `peft_config=`: loss and grad_norm per step, and every trained adapter weight after the run (SGD, no
clipping, so equal weights mean equal gradients at every step). Ulysses and auto backends, gradient
checkpointing (PEFT's `enable_input_require_grads` path), the memory flags, DeepSpeed ZeRO-3 and a resumed run.
One spawn per world size runs every configuration (`_trl_jobs.lora_worker`).
"""

from __future__ import annotations

import pytest

from tests.dist import _trainer_utils as U
from tests.dist import _trl_jobs as J

pytest.importorskip("peft", reason="peft is a dev dependency (pip install -e '.[dev]')")

RTOL = 1e-5
WEIGHT_RTOL = 1e-5
SPAWN_TIMEOUT_S = {1: 300, 2: 500}
FLAGS = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}

# name -> (world-1 reference config, SP=2 config); see `_trl_jobs.run_lora`.
CONFIGS = {
    "trainer_ulysses_gc": ({"gradient_checkpointing": True},) * 2,
    "sft_peft_config_auto_gc": (
        {"trainer": "sft", "peft_config": True, "gradient_checkpointing": True},
        {"trainer": "sft", "peft_config": True, "gradient_checkpointing": True, "sp_options": {"sp_backend": "auto"}},
    ),
    "trainer_flags": ({"gradient_checkpointing": True}, {"gradient_checkpointing": True, "flags": FLAGS}),
    "resume_full": ({"save_steps": 2}, {"save_steps": 2}),
    "resume": (None, {"resume_from": "resume_full/checkpoint-2"}),
}
# Its own spawn: the DeepSpeed state it creates stays in the process.
ZERO3 = {"trainer_zero3": {"zero": 3, "gradient_checkpointing": True, "sp": 2}}
REFERENCE_OF = {"trainer_zero3": "trainer_ulysses_gc", "resume": "resume_full"}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("peft")


def _world(world_size: int, out_root, zero3: bool = False) -> list[dict]:
    if zero3:
        return U.spawn_once(
            ("peft-zero3", 2), J.lora_worker, 2, str(out_root / "zero3"), ZERO3, timeout=SPAWN_TIMEOUT_S[2]
        )
    if world_size == 1:
        configs = {name: ref for name, (ref, _) in CONFIGS.items() if ref is not None}
    else:
        configs = {name: {**sp, "sp": 2} for name, (_, sp) in CONFIGS.items()}
    return U.spawn_once(
        ("peft", world_size),
        J.lora_worker,
        world_size,
        str(out_root / f"world{world_size}"),
        configs,
        timeout=SPAWN_TIMEOUT_S[world_size],
    )


def _assert_weights_equal(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want) and len(want) > 0
    worst = 0.0
    for name, ref in want.items():
        diff = float((got[name] - ref).abs().max() / ref.abs().max())
        assert diff <= WEIGHT_RTOL, f"{name}: rel {diff:.2e}"
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize("name", [n for n in CONFIGS if n not in ("resume_full", "resume")] + list(ZERO3))
def test_lora_sp2_matches_single_process(name, out_root, record_property):
    ref = _world(1, out_root)[0][REFERENCE_OF.get(name, name)]
    assert ref["peft"] == "PeftModel" and ref["attn"] == "sdpa"
    # LoRA on every linear layer of 2 decoder layers (7 each): A and B, nothing else trains.
    assert len(ref["trainable"]) == 28 and all("lora_" in n for n in ref["trainable"])
    worst = {}
    for rank_results in _world(2, out_root, zero3=name in ZERO3):
        result = rank_results[name]
        assert result["peft"] == "PeftModel" and result["attn"].startswith("hf_longctx_"), result["attn"]
        worst.update(U.compare_logs(result["logs"], ref["logs"], J.LORA_KEYS, RTOL))
        worst["weights"] = _assert_weights_equal(result["weights"], ref["weights"])
    assert {"loss", "grad_norm"} <= set(worst)
    record_property("max_rel_diff", worst)


def test_resumed_lora_sp2_run_equals_uninterrupted(out_root, record_property):
    for rank_results in _world(2, out_root):
        full, resumed = rank_results["resume_full"], rank_results["resume"]
        tail = [h for h in resumed["logs"] if h["step"] > 2]
        assert [h["step"] for h in tail] == [3, 4]
        diffs = U.compare_logs(tail, full["logs"][2:], J.LORA_KEYS, 1e-6)
        diffs["weights"] = _assert_weights_equal(resumed["weights"], full["weights"])
    record_property("max_rel_diff", diffs)

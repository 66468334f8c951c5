"""LoRA adapters under hf_longctx SP are exact: SP=2, SP=4 and DP=2 x SP=2 against one process without SP, per step.

`get_peft_model(model, LoraConfig(...))` handed to the stock `Trainer`, and `SFTTrainer` given either the PEFT
model or `peft_config=`: loss and grad_norm per step, and every trained adapter weight after the run (SGD, no
clipping, so equal weights mean equal gradients at every step). Every backend, read through the PEFT wrapper:
ulysses, ring (pass-KV and all-gather), hybrid 2 x 2 at SP=4, and auto (ulysses on the 4-head model, ring on
the 9-head / 3-KV one); gradient checkpointing (PEFT's `enable_input_require_grads` path), the memory flags,
DeepSpeed ZeRO-3 and a resumed run. One spawn per world size runs every configuration
(`_trl_jobs.lora_worker`); ZeRO-3 and the SP=4 runs have their own.
"""

from __future__ import annotations

import pytest

from tests.dist import _trainer_utils as U
from tests.dist import _trl_jobs as J

pytest.importorskip("peft", reason="peft is a dev dependency (pip install -e '.[dev]')")

RTOL = 1e-5
WEIGHT_RTOL = 1e-5
SPAWN_TIMEOUT_S = {1: 300, 2: 500, 4: 600}
FLAGS = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
RING_P2P = {"sp_backend": "ring", "ring_variant": "p2p"}
RING_AG = {"sp_backend": "ring", "ring_variant": "allgather"}
HYBRID = {"sp_backend": "hybrid", "ulysses_degree": 2}
AUTO = {"sp_backend": "auto"}
# SmolLM2-135M's head layout: 9 heads divide neither 2 nor 4, so auto picks ring at SP=2.
NINE = {"num_heads": 9, "num_kv_heads": 3, "hidden": 72}
GC = {"gradient_checkpointing": True}
SFT_PEFT_CONFIG = {"trainer": "sft", "peft_config": True, **GC}

# name -> (world-1 reference config or None, SP config); see `_trl_jobs.run_lora`. A None reference is
# REFERENCE_OF's run (the same world-1 configuration).
CONFIGS = {
    "trainer_ulysses_gc": (GC, GC),
    "sft_peft_config_auto_gc": (SFT_PEFT_CONFIG, {**SFT_PEFT_CONFIG, "sp_options": AUTO}),
    "trainer_flags": (None, {**GC, "flags": FLAGS}),
    "trainer_ring_gc": (None, {**GC, "sp_options": RING_P2P}),
    "sft_peft_config_ring_gc_flags": (None, {**SFT_PEFT_CONFIG, "sp_options": RING_AG, "flags": FLAGS}),
    "trainer_nine_auto_gc": ({**GC, "shape": NINE}, {**GC, "shape": NINE, "sp_options": AUTO}),
    "sft_peft_config_nine_auto_gc": (
        {**SFT_PEFT_CONFIG, "shape": NINE},
        {**SFT_PEFT_CONFIG, "shape": NINE, "sp_options": AUTO},
    ),
    # The world-1 reference of DP=2 x SP=2 (HYBRID4's spawn): both DP ranks' rows in one batch.
    "trainer_batch4_gc": ({**GC, "batch": 4}, None),
    "resume_full": ({"save_steps": 2}, {"save_steps": 2}),
    "resume": (None, {"resume_from": "resume_full/checkpoint-2"}),
}
# Its own spawn: the DeepSpeed state it creates stays in the process.
ZERO3 = {"trainer_zero3": {"zero": 3, "gradient_checkpointing": True, "sp": 2}}
# World 4: SP=4 hybrid 2 x 2 (Ulysses pairs, ring across them), the only LoRA run of the hybrid code, so not
# slow; and DP=2 x SP=2 Ulysses (DDP averaging two SP groups' adapters' gradients).
HYBRID4 = {
    "trainer_hybrid_gc": {**GC, "sp": 4, "sp_options": HYBRID},
    "sft_peft_config_hybrid_gc": {**SFT_PEFT_CONFIG, "sp": 4, "sp_options": {**HYBRID, "ring_variant": "allgather"}},
    "trainer_dp2_sp2_gc": {**GC, "sp": 2},
}
REFERENCE_OF = {
    "trainer_flags": "trainer_ulysses_gc",
    "trainer_zero3": "trainer_ulysses_gc",
    "resume": "resume_full",
    "trainer_ring_gc": "trainer_ulysses_gc",
    "sft_peft_config_ring_gc_flags": "sft_peft_config_auto_gc",
    "trainer_hybrid_gc": "trainer_ulysses_gc",
    "sft_peft_config_hybrid_gc": "sft_peft_config_auto_gc",
    "trainer_dp2_sp2_gc": "trainer_batch4_gc",
}
# What the SP model must run (its attention key, read through the PEFT wrapper): auto resolved per shape.
BACKEND_OF = {
    "sft_peft_config_auto_gc": "ulysses",
    "trainer_ring_gc": "ring",
    "sft_peft_config_ring_gc_flags": "ring",
    "trainer_nine_auto_gc": "ring",
    "sft_peft_config_nine_auto_gc": "ring",
    "trainer_hybrid_gc": "hybrid",
    "sft_peft_config_hybrid_gc": "hybrid",
}


@pytest.fixture(scope="module")
def out_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("peft")


def _world(world_size: int, out_root, run: str = "main") -> list[dict]:
    if run == "zero3":
        configs = ZERO3
    elif run == "hybrid":
        configs = HYBRID4
    elif world_size == 1:
        configs = {name: ref for name, (ref, _) in CONFIGS.items() if ref is not None}
    else:
        configs = {name: {**sp, "sp": 2} for name, (_, sp) in CONFIGS.items() if sp is not None}
    return U.spawn_once(
        ("peft", run, world_size),
        J.lora_worker,
        world_size,
        str(out_root / f"{run}{world_size}"),
        configs,
        timeout=SPAWN_TIMEOUT_S[world_size],
    )


def _sp_config(name: str) -> dict:
    return ZERO3.get(name) or HYBRID4.get(name) or CONFIGS[name][1]


def _sp_run(name: str, out_root) -> list[dict]:
    if name in ZERO3:
        return _world(2, out_root, "zero3")
    if name in HYBRID4:
        return _world(4, out_root, "hybrid")
    return _world(2, out_root)


def _assert_weights_equal(got: dict, want: dict) -> float:
    assert sorted(got) == sorted(want) and len(want) > 0
    worst = 0.0
    for name, ref in want.items():
        diff = float((got[name] - ref).abs().max() / ref.abs().max())
        assert diff <= WEIGHT_RTOL, f"{name}: rel {diff:.2e}"
        worst = max(worst, diff)
    return worst


@pytest.mark.parametrize(
    "name",
    [n for n, (_, sp) in CONFIGS.items() if sp is not None and n not in ("resume_full", "resume")]
    + list(ZERO3)
    + list(HYBRID4),
)
def test_lora_sp_matches_single_process(name, out_root, record_property):
    ref = _world(1, out_root)[0][REFERENCE_OF.get(name, name)]
    assert ref["peft"] == "PeftModel" and ref["attn"] == "sdpa"
    # LoRA on every linear layer of 2 decoder layers (7 each): A and B, nothing else trains.
    assert len(ref["trainable"]) == 28 and all("lora_" in n for n in ref["trainable"])
    worst = {}
    backend = BACKEND_OF.get(name, "ulysses")
    for rank_results in _sp_run(name, out_root):
        result = rank_results[name]
        assert result["peft"] == "PeftModel" and result["attn"].startswith(f"hf_longctx_{backend}_"), result["attn"]
        if name not in ZERO3:  # (DeepSpeed's own hooks on lm_head would read as the tiled loss)
            flags = _sp_config(name).get("flags", {})
            assert result["memory"] == {flag: flag in flags for flag in FLAGS}, result["memory"]
        worst.update(U.compare_logs(result["logs"], ref["logs"], J.LORA_KEYS, RTOL))
        worst["weights"] = _assert_weights_equal(result["weights"], ref["weights"])
    assert {"loss", "grad_norm"} <= set(worst)
    record_property("max_rel_diff", worst)


def test_resumed_lora_sp2_run_equals_uninterrupted(out_root, record_property):
    for rank_results in _sp_run("resume", out_root):
        full, resumed = rank_results["resume_full"], rank_results["resume"]
        tail = [h for h in resumed["logs"] if h["step"] > 2]
        assert [h["step"] for h in tail] == [3, 4]
        diffs = U.compare_logs(tail, full["logs"][2:], J.LORA_KEYS, 1e-6)
        diffs["weights"] = _assert_weights_equal(resumed["weights"], full["weights"])
    record_property("max_rel_diff", diffs)

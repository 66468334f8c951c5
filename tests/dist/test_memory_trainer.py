"""The memory flags through the stock `Trainer` and TRL's `SFTTrainer`: every logged step's loss and
grad_norm (and SFT's token accuracy, entropy, token count), eval loss and `predict` logits equal the same
run without the flags, at SP=1 (one process) and SP=2 (two), with gradient accumulation, packing and
completion-only labels. One spawn per world size runs every configuration.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.dist import _sft_utils as SU
from tests.dist import _trainer_utils as U

RTOL = 1e-5
ALL = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
TRAINER = {"ga": 2, "steps": 3, "eval_data": (("eval", 7),), "predict": ("eval", 4), "raw_logits": True}
# Packed rows whose documents carry completion-only labels (some SP shards hold no valid label).
SFT = {"packing": True, "data": ("completion", 40), "completion_only": True, "eval_data": {"even": ("plain", 8)}}


def memory_worker(rank: int, world_size: int, out_dir: str) -> dict:
    import os

    sp = world_size
    runs = {}
    for name, flags in (("off", None), ("on", ALL)):
        runs[("trainer", name)] = U.run_trainer(os.path.join(out_dir, f"t_{name}"), sp=sp, flags=flags, **TRAINER)
        runs[("sft", name)] = SU.run_sft(os.path.join(out_dir, f"s_{name}"), sp=sp, flags=flags, steps=3, **SFT)
    return runs


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("memory_trainer")


def _runs(world_size: int, out_root) -> list[dict]:
    return U.spawn_once(
        ("memory_trainer", world_size),
        memory_worker,
        world_size,
        str(out_root / f"world{world_size}"),
        timeout=600,
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_trainer_with_flags_matches_without(world_size, out_root, record_property):
    for rank_runs in _runs(world_size, out_root):
        on, off = rank_runs[("trainer", "on")], rank_runs[("trainer", "off")]
        assert all(on["memory"].values()) and not any(off["memory"].values())
        worst = U.compare_logs(on["logs"], off["logs"], ("loss", "grad_norm"), RTOL)
        assert set(worst) == {"loss", "grad_norm"} and len(off["logs"]) == 3
        assert U.rel_diff(on["eval_loss"][7], off["eval_loss"][7]) <= RTOL
        assert U.rel_diff(on["predict"]["loss"], off["predict"]["loss"]) <= RTOL
        # Real tokens only: at sp_size=1 the config runs hf_longctx's per-document attention, under which a
        # right-padding position also sees the padding before it (its logits are read by no loss).
        got, want = on["predict"]["predictions"], off["predict"]["predictions"]
        real = np.asarray(off["predict"]["label_ids"]) != -100
        assert got.shape == want.shape and real.sum() > 0
        assert np.abs(got[real] - want[real]).max() <= 1e-5 * np.abs(want[real]).max()
        record_property(f"trainer_max_rel_diff_sp{world_size}", worst)


@pytest.mark.parametrize("world_size", [1, 2])
def test_sft_trainer_with_flags_matches_without(world_size, out_root, record_property):
    for rank_runs in _runs(world_size, out_root):
        on, off = rank_runs[("sft", "on")], rank_runs[("sft", "off")]
        assert all(on["memory"].values()) and not any(off["memory"].values())
        worst = SU.assert_sft_runs_match(on, off, RTOL)
        record_property(f"sft_max_rel_diff_sp{world_size}", worst)

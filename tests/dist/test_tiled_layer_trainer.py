"""`tiled_layer` through the stock `Trainer` and TRL's `SFTTrainer`: every logged step's loss and grad_norm
(SFT: also token accuracy, entropy, token count) and the eval losses equal the same run without it, at SP=1
(one process, right-padded rows) and Ulysses SP=2, with gradient accumulation, packing and completion-only
labels, with tiled_loss, tiled_mlp and offload_activations on too (the tiled layers' saved inputs then go through
the offload's hooks)."""

from __future__ import annotations

import pytest

from tests.dist import _sft_utils as SU
from tests.dist import _trainer_utils as U

RTOL = 1e-5
FLAGS = {"tiled_layer": 2, "tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
TRAINER = {"ga": 2, "steps": 2, "eval_data": (("eval", 7),)}
SFT = {"packing": True, "data": ("completion", 40), "completion_only": True, "eval_data": {"even": ("plain", 8)}}


def tiled_trainer_worker(rank: int, world_size: int, out_dir: str) -> dict:
    import os

    from hf_longctx.memory import tiled_layer

    runs, calls = {}, []
    original = tiled_layer._TiledLayer.run
    tiled_layer._TiledLayer.run = lambda self, *a: calls.append(1) or original(self, *a)  # count tiled calls
    for name, flags in (("off", None), ("on", FLAGS)):
        calls.clear()
        runs[("trainer", name)] = U.run_trainer(
            os.path.join(out_dir, f"t_{name}"), sp=world_size, flags=flags, **TRAINER
        )
        runs[("trainer", name, "calls")] = len(calls)
        calls.clear()
        runs[("sft", name)] = SU.run_sft(os.path.join(out_dir, f"s_{name}"), sp=world_size, flags=flags, steps=2, **SFT)
        runs[("sft", name, "calls")] = len(calls)
    return runs


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiled_trainer")


def _runs(world_size: int, out_root) -> list[dict]:
    path = str(out_root / f"world{world_size}")
    return U.spawn_once(("tiled_trainer", world_size), tiled_trainer_worker, world_size, path, timeout=600)


@pytest.mark.parametrize("world_size", [1, 2])
def test_trainer_with_tiled_layer_matches_without(world_size, out_root, record_property):
    for rank_runs in _runs(world_size, out_root):
        on, off = rank_runs[("trainer", "on")], rank_runs[("trainer", "off")]
        assert rank_runs[("trainer", "off", "calls")] == 0 and rank_runs[("trainer", "on", "calls")] > 0
        assert on["wrapped"] == off["wrapped"] == "DistributedDataParallel"  # its gradient hooks see the tiles
        worst = U.compare_logs(on["logs"], off["logs"], ("loss", "grad_norm"), RTOL)
        assert set(worst) == {"loss", "grad_norm"} and len(off["logs"]) == 2
        assert U.rel_diff(on["eval_loss"][7], off["eval_loss"][7]) <= RTOL
        record_property(f"trainer_max_rel_diff_sp{world_size}", worst)


@pytest.mark.parametrize("world_size", [1, 2])
def test_sft_trainer_with_tiled_layer_matches_without(world_size, out_root, record_property):
    for rank_runs in _runs(world_size, out_root):
        on, off = rank_runs[("sft", "on")], rank_runs[("sft", "off")]
        assert rank_runs[("sft", "off", "calls")] == 0 and rank_runs[("sft", "on", "calls")] > 0
        worst = SU.assert_sft_runs_match(on, off, RTOL)
        record_property(f"sft_max_rel_diff_sp{world_size}", worst)

"""Qwen3-Next and Qwen3.5 under SP are exact: Gated DeltaNet layers head-parallel, gated attention by the backend.

SP=2 (ulysses, auto, ring: contiguous and zigzag token layouts) and SP=4 (slow) against the plain upstream
model in this process, one forward per document (`_linear_jobs.reference`): loss rel <= 1e-6 and every
parameter's gradient rel <= 1e-5 of its largest entry. Single documents, a right-padded batch, and packed
rows, whose documents each start with a fresh state (upstream's torch path would carry it across). And the
stock Trainer at SP=2 against one process: per-step loss and grad_norm rel <= 1e-5.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch

from tests._dist import run_distributed
from tests.dist import _linear_jobs as J

SPAWN_TIMEOUT_S = 300
NEXT, Q35 = "qwen3_next", "qwen3_5"
COMBOS_2 = (
    *((NEXT, "ulysses", case, False) for case in J.CASES),
    (NEXT, "auto", "single", False),
    (NEXT, "auto", "packed3", False),
    (NEXT, "ring", "packed_bs2", False),
    (NEXT, "ulysses", "packed3", True),
    (Q35, "ulysses", "packed_bs2", False),
    (Q35, "ring", "padded_bs2", False),
)
COMBOS_4 = (
    (NEXT, "ulysses", "packed_bs2", False),
    (NEXT, "auto", "padded_bs2", False),
    (NEXT, "ring", "packed3", False),
    (NEXT, "hybrid", "packed3", False),
    (Q35, "ulysses", "packed3", False),
)

_runs: dict[int, object] = {}
_refs: dict[tuple[str, str], tuple[float, dict[str, torch.Tensor]]] = {}
PADDED_LEN = 152  # SEQ_LEN 151 padded to a multiple of 2, 4 (zigzag at SP=2, contiguous at SP=4) and 8


def _spawn(world_size: int, combos) -> dict:
    if world_size not in _runs:
        try:
            if world_size == 2:  # plus the Trainer run, in the same spawn
                out_dir = tempfile.mkdtemp(prefix="hf_longctx_linear_")
                runs = run_distributed(J.sp2_worker, 2, combos, out_dir, timeout=SPAWN_TIMEOUT_S)
            else:
                runs = run_distributed(J.parity_worker, world_size, combos, timeout=SPAWN_TIMEOUT_S)
            _runs[world_size] = runs
        except Exception as exc:  # noqa: BLE001 - re-raised by every dependent test
            _runs[world_size] = exc
    if isinstance(_runs[world_size], Exception):
        raise _runs[world_size]
    return _runs[world_size]


def _reference(arch: str, case: str) -> tuple[float, dict[str, torch.Tensor]]:
    if (arch, case) not in _refs:
        _refs[(arch, case)] = J.reference(J.tiny_qwen3_next(arch=arch), case, PADDED_LEN)
    return _refs[(arch, case)]


def _assert_exact(result: dict, arch: str, case: str) -> None:
    ref_loss, ref_grads = _reference(arch, case)
    assert abs(result["loss"] - ref_loss) / abs(ref_loss) <= J.LOSS_RTOL, (result["loss"], ref_loss)
    grads = result["grads"]
    assert grads.keys() == ref_grads.keys()
    errors = {}
    for name, ref in ref_grads.items():
        scale, diff = float(ref.abs().max()), float((grads[name] - ref).abs().max())
        errors[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= J.GRAD_RTOL, (worst, errors[worst])
    # The Gated DeltaNet parameters (sliced per rank) really received gradient.
    assert float(ref_grads["model.layers.0.linear_attn.A_log"].abs().max()) > 0


@pytest.mark.parametrize("combo", COMBOS_2, ids=lambda c: "-".join(map(str, c)))
def test_sp2_matches_the_unsharded_model(combo):
    results = _spawn(2, COMBOS_2)
    arch, backend, case, _ = combo
    _assert_exact(results[0][combo], arch, case)
    assert [r[combo]["loss"] for r in results] == [results[0][combo]["loss"]] * 2
    # Every decoder layer ran through SP: 1 attention layer, 2 head-parallel linear layers (more under checkpointing).
    attention, linear = results[0][combo]["calls"]
    assert attention >= 1 and linear >= 2
    assert not results[0][combo]["patched_after"]  # remove() took every instance patch away
    if backend == "ring":
        assert results[0][combo]["ran"] == ("ring", "zigzag")


def test_auto_resolves_to_a_backend_and_stays_exact():
    results = _spawn(2, COMBOS_2)
    assert results[0][(NEXT, "auto", "single", False)]["ran"][0] in ("ulysses", "ring", "hybrid")


def test_upstream_torch_path_carries_state_across_packed_documents():
    # Why the reference runs documents apart: upstream's torch fallback on the packed row lets the first
    # documents' convolution and recurrent state reach the last one, far beyond float32 noise, so the
    # packed cases really test that every document starts fresh.
    assert J.upstream_leak(J.tiny_qwen3_next(), "packed3") > 1e3 * J.GRAD_RTOL


def test_trainer_sp2_matches_single_process_per_step(tmp_path):
    # Stock Trainer, right-padded rows, gradient checkpointing, SGD: per-step loss and grad_norm.
    ref = J.run_trainer(str(tmp_path / "sp1"), 1)
    got = _spawn(2, COMBOS_2)
    assert len(ref) == J.TRAINER_STEPS and got[0]["trainer"] == got[1]["trainer"]
    for mine, want in zip(got[0]["trainer"], ref, strict=True):
        assert mine["step"] == want["step"]
        for key in ("loss", "grad_norm"):
            assert abs(mine[key] - want[key]) / abs(want[key]) <= J.GRAD_RTOL, (key, mine, want)


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMBOS_4, ids=lambda c: "-".join(map(str, c)))
def test_sp4_matches_the_unsharded_model(combo):
    results = _spawn(4, COMBOS_4)
    arch, backend, case, _ = combo
    _assert_exact(results[0][combo], arch, case)
    assert len({r[combo]["loss"] for r in results}) == 1
    if backend in ("ring", "hybrid"):
        assert results[0][combo]["ran"] == (backend, "zigzag")

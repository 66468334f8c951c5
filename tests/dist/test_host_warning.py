"""Rank 0 warns at the first step when an all-to-all spans hosts: 4 gloo ranks as 2 "hosts" of 2 (each rank's
`socket.gethostname` patched, LOCAL_WORLD_SIZE=2 as torchrun sets it), through `verify_first_step` with a real SP
handle on a tiny model. Ulysses over all 4 ranks warns; hybrid with its Ulysses pairs inside a host, auto (which
picks that hybrid), DP 2 x SP 2 and one host do not; hybrid with hosts interleaved does (its Ulysses part spans)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace
from unittest import mock

import pytest

import hf_longctx
from hf_longctx.integrations.trainer import first_step
from hf_longctx.integrations.trainer.state import SequenceParallelState
from tests._dist import run_distributed
from tests._models import tiny_model

WORLD = 4
# name: (sp_backend, sp_size, ulysses_degree, the host of ranks 0-3)
CASES = {
    "ulysses_two_hosts": ("ulysses", 4, None, (0, 0, 1, 1)),
    "hybrid_inside_hosts": ("hybrid", 4, 2, (0, 0, 1, 1)),
    "auto_two_hosts": ("auto", 4, None, (0, 0, 1, 1)),
    "dp2_sp2_two_hosts": ("ulysses", 2, None, (0, 0, 1, 1)),
    "ulysses_one_host": ("ulysses", 4, None, (0, 0, 0, 0)),
    "hybrid_interleaved_hosts": ("hybrid", 4, 2, (0, 1, 0, 1)),
}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def first_step_lines_worker(rank: int, world_size: int) -> dict[str, list[str]]:
    """Each case's first-step log lines on this rank (rank 0 logs; the others log nothing)."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    lines = _Lines()
    first_step.logger.addHandler(lines)
    out = {}
    for name, (backend, sp, degree, hosts) in CASES.items():
        lines.lines.clear()
        with mock.patch("socket.gethostname", return_value=f"node{hosts[rank]}"):
            groups = hf_longctx.SequenceParallelGroups.build(sp)
            model = tiny_model("llama", num_heads=4, num_kv_heads=4)
            handle = hf_longctx.enable_sequence_parallel(model, groups, backend, ulysses_degree=degree)
            state = SequenceParallelState(
                config=SimpleNamespace(sp_size=sp), groups=groups, handles=[handle], replicated_outputs=True
            )
            trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: m, state=SimpleNamespace()))
            first_step.verify_first_step(trainer, state, model, {})
            handle.remove()
            groups.destroy()
        out[name] = list(lines.lines)
    return out


@pytest.fixture(scope="module")
def lines() -> list[dict[str, list[str]]]:
    return run_distributed(first_step_lines_worker, WORLD, timeout=240)


def _warnings(case_lines: list[str]) -> list[str]:
    return [line for line in case_lines if "spans hosts" in line]


def test_ulysses_across_two_hosts_warns_once_on_rank_0_naming_auto_and_hybrid(lines):
    (warning,) = _warnings(lines[0]["ulysses_two_hosts"])
    assert warning.startswith("hf_longctx: the all-to-all of the Ulysses SP group spans hosts: ranks 0-3 on 2 hosts")
    assert 'sp_backend="auto"' in warning and 'sp_backend="hybrid"' in warning and "divides 2" in warning
    assert all(rank_lines[name] == [] for rank_lines in lines[1:] for name in CASES)


@pytest.mark.parametrize("name", ["hybrid_inside_hosts", "auto_two_hosts", "dp2_sp2_two_hosts", "ulysses_one_host"])
def test_all_to_all_inside_a_host_does_not_warn(lines, name):
    (line,) = lines[0][name]  # the layout line only
    assert "sequence parallelism on 4 ranks (2 nodes x 2)" in line


def test_hybrid_whose_ulysses_part_spans_hosts_warns(lines):
    (warning,) = _warnings(lines[0]["hybrid_interleaved_hosts"])
    assert (
        "the hybrid backend's Ulysses group (ulysses_degree=2) spans hosts: ranks 0-1 on 2 hosts (2 such groups)"
        in warning
    )

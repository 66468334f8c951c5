"""Every collective goes through `hf_longctx.distributed.comm`, which puts tensors on a device
the group's backend takes.

NCCL only accepts CUDA tensors (a CPU signature tensor failed the custom loop on GPU); gloo takes CPU ones.
The rule is a pure function of the backend string, tested here without a process group or a GPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import hf_longctx
from hf_longctx.distributed import comm

PACKAGE = Path(hf_longctx.__file__).parent
COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}


@pytest.mark.parametrize(
    ("backend", "tensor_device", "expected"),
    [
        ("nccl", "cpu", "cuda:0"),  # a CPU tensor handed to NCCL must move to the current GPU
        ("nccl", "cuda:0", "cuda:0"),
        ("gloo", "cpu", "cpu"),
        ("gloo", "cuda:0", "cpu"),  # gloo without CUDA support for every op: go through the host
        ("cpu:gloo,cuda:nccl", "cpu", "cpu"),  # a multi-device default group takes both
        ("cpu:gloo,cuda:nccl", "cuda:0", "cuda:0"),
        ("undefined-backend", "cuda:0", "cuda:0"),  # unknown backends keep the tensor where it is
    ],
)
def test_group_device_follows_the_backend(monkeypatch, backend, tensor_device, expected):
    monkeypatch.setattr(comm.dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert comm.group_device(object(), torch.device(tensor_device)) == torch.device(expected)


def test_no_group_means_no_move():
    assert comm.group_device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)


def _raw_collectives(path: Path) -> list[str]:
    """`dist.<collective>` calls and references (`dist.P2POp(dist.isend, ...)`) in one source file."""
    return [
        f"{path.relative_to(PACKAGE)}:{node.lineno} dist.{node.attr}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in COLLECTIVES
        and isinstance(node.value, ast.Name)
        and node.value.id == "dist"
    ]


def test_only_comm_issues_collectives():
    """A raw torch.distributed collective elsewhere would bypass the device rule and the byte counters.

    Only `distributed/comm.py` issues them (and `_compat.py` names one across torch versions for it): ring
    attention's transport (`distributed/ring_comm.py`) is checked like every other module, since a gloo group
    on a GPU needs the same host round trip there.
    """
    comm_py, exempt = PACKAGE / "distributed" / "comm.py", {PACKAGE / "distributed" / "comm.py", PACKAGE / "_compat.py"}
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path not in exempt for hit in _raw_collectives(path)]
    assert offenders == [], offenders
    assert _raw_collectives(comm_py), "the guard must see the collectives comm.py does issue"


def test_helpers_without_a_group_are_local():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(comm.all_gather_stacked(x, None), x.unsqueeze(0))
    assert torch.equal(comm.all_gather_sequence(x, None), x)
    assert torch.equal(comm.all_reduce_sum(x, None), x)
    assert comm.all_gather_object({"a": 1}, None) == [{"a": 1}]

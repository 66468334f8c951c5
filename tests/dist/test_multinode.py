"""Two simulated nodes on one machine: two `torchrun --nnodes 2 --node_rank i` launches on localhost with
a shared rendezvous, 2 ranks each, SP=4. Hybrid 2 x 2 (and auto, which must choose it: Ulysses never
leaves a node) keeps every Ulysses group inside a node, runs its rings across the nodes, and matches
the unsharded loss and every gradient."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from tests._dist import REPO_ROOT
from tests.dist import _multinode_worker as W
from tests.dist import _parity as P

TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("multinode") / "result.pt")
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(REPO_ROOT)}
    procs = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node)]
        cmd += ["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port]
        cmd += ["-m", "tests.dist._multinode_worker", out]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("run", sorted(W.RUNS))
def test_two_nodes_keep_ulysses_inside_a_node_and_match_the_reference(two_nodes, run):
    result = two_nodes[run]
    assert two_nodes["ranks_per_node"] == 2
    assert result["backend"] == ("hybrid", 2)
    node_of = {rank: r["node"] for rank, r in enumerate(result["ranks"])}
    assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}
    for r in result["ranks"]:
        assert len({node_of[x] for x in r["ulysses"]}) == 1  # all-to-all inside a node
        assert len({node_of[x] for x in r["ring"]}) == 2  # ring hops across the nodes
    ref_loss, ref_grads, _ = P.reference_loss_and_grads(W.SPEC.build(), P.make_case("packed3"))
    assert all(P.loss_error(r["loss"], ref_loss) <= P.LOSS_RTOL for r in result["ranks"])
    errors = P.grad_errors(result["grads"], ref_grads)
    assert max(errors.values()) <= P.GRAD_RTOL, max(errors, key=errors.get)

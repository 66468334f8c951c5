"""Every shipped 2-node launch runs as ONE job: two "nodes" of 2 CPU processes each on 127.0.0.1.

The cases are the launch lines of docs/launch.md with the node's rank, node 0's address (127.0.0.1), 4 processes
instead of 16 and the tiny CPU recipe (SP=2) shrunk to 3 steps of 512 tokens:

- `deepspeed`: `accelerate launch --config_file configs/2nodes_sp8.yaml` (ZeRO-3 through DeepSpeed's multinode
  launcher `standard`: accelerate runs torchrun on each node);
- `fsdp2`: `accelerate launch --config_file configs/2nodes_fsdp2_sp8.yaml`;
- `torchrun`: `torchrun --nnodes 2 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint ... --rdzv_id ...` (DDP);
- `slurm`: configs/slurm_2nodes.sbatch run by bash, its `srun` line started once per node by the stand-ins in
  tests/dist/slurm_standin (`srun`, `scontrol`).

Each asserts one job: every rank was started with world size 4; SP groups of 2 inside a node, DP groups of 2 across
the nodes; one rank-0 first-step line "on 4 ranks (2 nodes x 2): DP 2 x SP 2, engine E"; the per-step loss of the
1-process run without SP on the same rows (2 rows a step, as DP 2 x 1 row) within 1e-5 relative (float32).
The DeepSpeed YAML without `deepspeed_multinode_launcher: standard` (f1bc042's) fails the world-size check: each
node's DeepSpeed launcher starts a job of its own, world size 2, seen as its ranks start (on separate machines
they would train apart; here the second job would also collide with the first on node 0's port and hang).
tests/dist/cpu_site stands in for the GPU-only settings and records what each rank is (its `sitecustomize`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests._dist import REPO_ROOT

NODES, PER_NODE, SP = 2, 2, 2
WORLD = NODES * PER_NODE
RECIPE = ["recipes/sft.py", "--config", "recipes/tiny_llama_4k_sp2.yaml"]
SMALL = ["--max_length", "512", "--max_steps", "3", "--max_windows", "6", "--tiny_layers", "1", "--save_strategy", "no"]
LOSS_RTOL = 1e-5
TIMEOUT_S = 240
HEAD = "127.0.0.1"
CPU_SITE = REPO_ROOT / "tests" / "dist" / "cpu_site"
SLURM_STANDIN = REPO_ROOT / "tests" / "dist" / "slurm_standin"
FIRST_STEP = re.compile(
    r"sequence parallelism on (\d+) ranks \((\d+) nodes? x (\d+)\): DP (\d+) x SP (\d+), engine ([^,]+),"
)

# A case: (folder of this run, free port) -> one (command, extra environment) per process the test starts.
Commands = list[tuple[list[str], dict[str, str]]]


@dataclass
class Job:
    """What the processes of one launch left: logs, exit codes and every rank's records."""

    logs: list[str]
    returncodes: list[int | None]
    timed_out: bool
    starts: list[dict]
    groups: list[dict]
    output_dir: Path

    def tail(self) -> str:
        return "\n".join(log[-3000:] for log in self.logs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HEAD, 0))
        return s.getsockname()[1]


def _records(folder: Path, kind: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{kind}_*.json"))]


def _stop(proc: subprocess.Popen) -> None:
    """Kill a "node" and everything it started (its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the node and all its ranks have exited
    proc.wait()


def _environment(tmp: Path, records: Path) -> dict[str, str]:
    """The environment of every "node": the CPU stand-ins and records of cpu_site, this interpreter's launchers."""
    return {
        **os.environ,
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "PYTHONPATH": f"{CPU_SITE}:{REPO_ROOT}",
        "HF_LONGCTX_CPU_LAUNCH": "1",
        "HF_LONGCTX_LAUNCH_RECORD": str(records),
        "DS_ENV_FILE": str(tmp / ".deepspeed_env"),  # accelerate's pdsh route writes it (in the repository root)
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _launch(commands: Commands, tmp: Path) -> Job:
    """Start every "node" and wait for all, stopping all of them at the first rank started with another world size
    (two separate jobs), at a node that fails (its peer would wait for it) or at TIMEOUT_S."""
    records, out = tmp / "records", tmp / "out"
    records.mkdir()
    base = _environment(tmp, records)
    logs = [tmp / f"node{i}.log" for i in range(len(commands))]
    procs, timed_out = [], False
    try:
        for (cmd, env), log in zip(commands, logs, strict=True):
            with open(log, "w") as f:
                cmd = [*cmd, "--output_dir", str(out)]
                procs.append(
                    subprocess.Popen(
                        cmd,
                        cwd=REPO_ROOT,
                        env={**base, **env},
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        while any(p.poll() is None for p in procs):
            if any(r["world"] != WORLD for r in _records(records, "start")) or any(p.poll() for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.5)
    finally:
        for proc in procs:
            _stop(proc)
    return Job(
        logs=[log.read_text(errors="replace") for log in logs],
        returncodes=[p.returncode for p in procs],
        timed_out=timed_out,
        starts=_records(records, "start"),
        groups=_records(records, "groups"),
        output_dir=out,
    )


def _accelerate(config: str, recipe_args: tuple[str, ...] = ()) -> Callable[[Path, int], Commands]:
    """The 2-node `accelerate launch` line of `config`, once per node."""

    def commands(tmp: Path, port: int) -> Commands:
        launch = ["accelerate", "launch", "--config_file", config, "--num_processes", str(WORLD)]
        return [
            (
                [*launch, "--machine_rank", str(node), "--main_process_ip", HEAD, "--main_process_port", str(port)]
                + [*RECIPE, *SMALL, *recipe_args],
                {"HF_LONGCTX_TEST_NODE": str(node)},
            )
            for node in range(NODES)
        ]

    return commands


def _torchrun(tmp: Path, port: int) -> Commands:
    """The 2-node `torchrun` line (c10d rendezvous on node 0), once per node."""
    launch = ["torchrun", "--nnodes", str(NODES), "--nproc_per_node", str(PER_NODE), "--rdzv_backend", "c10d"]
    launch += ["--rdzv_endpoint", f"{HEAD}:{port}", "--rdzv_id", "sft1"]
    return [([*launch, *RECIPE, *SMALL], {"HF_LONGCTX_TEST_NODE": str(node)}) for node in range(NODES)]


def _slurm(tmp: Path, port: int) -> Commands:
    """`sbatch configs/slurm_2nodes.sbatch ARGS` without Slurm: bash runs the script as the batch step does."""
    allocation = {"SLURM_JOB_NODELIST": HEAD, "SLURM_NNODES": str(NODES), "SLURM_GPUS_ON_NODE": str(PER_NODE)}
    env = {**allocation, "RECIPE": RECIPE[2], "MAIN_NODE_PORT": str(port)}
    env["PATH"] = f"{SLURM_STANDIN}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"
    return [(["bash", "configs/slurm_2nodes.sbatch", *SMALL], env)]


# DeepSpeed on CPU needs gloo named (tests/dist/cpu_site/sitecustomize.py).
DEEPSPEED = ("--ddp_backend", "gloo")
CASES = {
    "deepspeed": (_accelerate("configs/2nodes_sp8.yaml", DEEPSPEED), "DeepSpeed ZeRO-3"),
    "fsdp2": (_accelerate("configs/2nodes_fsdp2_sp8.yaml"), "FSDP2"),
    "torchrun": (_torchrun, "DDP"),
    "slurm": (_slurm, "FSDP2"),
}


def _losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Per-step loss of the same recipe on one process without SP, 2 rows a step (the DP=2 job's rows)."""
    out = tmp_path_factory.mktemp("reference")
    cmd = [sys.executable, *RECIPE, *SMALL, "--sp_size", "1", "--per_device_train_batch_size", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [*cmd, "--output_dir", str(out)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return _losses(out)


def assert_one_job(job: Job, engine: str, reference: list[float]) -> None:
    """World size 4 from the start, SP inside a node and DP across, the first-step line, the reference loss."""
    assert not job.timed_out, job.tail()
    worlds = sorted(r["world"] for r in job.starts)
    assert worlds == [WORLD] * WORLD, f"world size per started rank: {worlds}\n{job.tail()}"
    assert job.returncodes == [0] * len(job.returncodes), job.tail()
    node_of = {r["rank"]: r["node"] for r in job.starts}
    assert sorted(node_of) == list(range(WORLD)) and sorted(node_of.values()) == [0, 0, 1, 1], node_of
    assert len(job.groups) == WORLD, job.tail()
    for r in job.groups:
        assert len(r["sp"]) == SP and {node_of[x] for x in r["sp"]} == {r["node"]}, r  # Ulysses inside the node
        assert len(r["dp"]) == WORLD // SP and {node_of[x] for x in r["dp"]} == {0, 1}, r  # DP across the nodes
    lines = [m.groups() for log in job.logs for m in FIRST_STEP.finditer(log)]
    assert lines == [(str(WORLD), str(NODES), str(PER_NODE), str(WORLD // SP), str(SP), engine)], lines
    losses = _losses(job.output_dir)
    assert len(losses) == len(reference) == 3
    for loss, ref in zip(losses, reference, strict=True):
        assert abs(loss - ref) <= LOSS_RTOL * abs(ref), (losses, reference)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_node_launch_is_one_job_with_the_loss_of_the_run_without_sp(case, reference, tmp_path):
    commands, engine = CASES[case]
    assert_one_job(_launch(commands(tmp_path, _free_port()), tmp_path), engine, reference)


@pytest.mark.slow
def test_deepspeed_yaml_without_the_standard_launcher_starts_a_job_per_node(reference, tmp_path):
    """f1bc042's configs/2nodes_sp8.yaml: accelerate runs DeepSpeed's pdsh launcher without a hostfile."""
    config = tmp_path / "2nodes_sp8_f1bc042.yaml"
    lines = (REPO_ROOT / "configs" / "2nodes_sp8.yaml").read_text().splitlines(keepends=True)
    config.write_text("".join(line for line in lines if "deepspeed_multinode_launcher:" not in line))
    assert "deepspeed_multinode_launcher" not in yaml.safe_load(config.read_text())["deepspeed_config"]
    job = _launch(_accelerate(str(config), DEEPSPEED)(tmp_path, _free_port()), tmp_path)
    assert not job.timed_out, job.tail()  # stopped as the ranks started, not after a hang
    assert {r["world"] for r in job.starts} == {PER_NODE}, job.starts  # each node a job of its own
    with pytest.raises(AssertionError, match="world size per started rank"):
        assert_one_job(job, "DeepSpeed ZeRO-3", reference)

"""The process side of `hf-longctx check`: the torchrun workers and their launch, timeout and clean-up.

`launch` starts `python -m hf_longctx.check --worker SPEC` under torchrun; `worker_main` is that entry:
one SP=K training step on K gloo ranks, with rank 0 writing the loss and the averaged gradients.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hf_longctx.check import vlm
from hf_longctx.check.model import build_model, check_batch, step, weights_sha256

_GRACE_S = 10.0
_LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a torchrun worker needs, written to a JSON file by the parent.

    Attributes:
        config_dir: folder holding the shrunk `config.json` (the parent's model is built from it too).
        attn: attention implementation, "sdpa" or "eager".
        seed: `torch.manual_seed` before building the model.
        seq_len: unpadded sequence length of the batch.
        batch_size: rows in the batch.
        packed: pack three documents per row (restarting position ids).
        output: file rank 0 writes the results to (`torch.save`).
        pid_dir: folder where every rank writes its process id (to clean up after a timeout).
        fault: one of `args.FAULTS` to break the run on purpose, or None.
        backend, ulysses_degree, ring_variant: the SP backend under test (`enable_sequence_parallel`).
    """

    config_dir: str
    attn: str
    seed: int
    seq_len: int
    batch_size: int
    packed: bool
    output: str
    pid_dir: str
    fault: str | None = None
    backend: str = "ulysses"
    ulysses_degree: int | None = None
    ring_variant: str | None = None

    def save(self, path: Path) -> None:
        """Write the spec as JSON to `path`."""
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> WorkerSpec:
        """Read a spec written by `save`."""
        return cls(**json.loads(Path(path).read_text()))


def worker_main(spec_path: str) -> None:
    """One torchrun rank: SP loss and gradients averaged over the group; rank 0 writes them.

    Args:
        spec_path: the JSON `WorkerSpec` written by the parent.

    Raises:
        ValueError: from the library, e.g. an unsupported attention implementation.
    """
    import torch.distributed as dist

    from hf_longctx.attention.registry import enable_sequence_parallel
    from hf_longctx.data.consistency import shard_batch
    from hf_longctx.distributed.comm import all_gather_object, all_reduce_sum, barrier
    from hf_longctx.distributed.groups import SequenceParallelGroups

    spec = WorkerSpec.load(spec_path)
    Path(spec.pid_dir, f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        groups = SequenceParallelGroups.build(dist.get_world_size())
        model = build_model(spec.config_dir, spec.attn, spec.seed)
        batch = check_batch(model, spec.seq_len, spec.batch_size, spec.packed, spec.seed)
        options = {"backend": spec.backend, "ulysses_degree": spec.ulysses_degree, "ring_variant": spec.ring_variant}
        with enable_sequence_parallel(model, groups, **options):
            rows, hook = vlm.record_tower_rows(model) if vlm.is_vision_language(model.config) else ([], None)
            shard = shard_batch(batch, groups)
            if spec.fault == "skip-positions":
                bs, local = shard["input_ids"].shape
                shard["position_ids"] = torch.arange(local).expand(bs, local).clone()
            loss, grads = step(model, shard, groups)
            if hook is not None:
                hook.remove()
        # What a DP engine does: average the gradients over the ranks.
        flat = all_reduce_sum(torch.cat([g.reshape(-1) for g in grads.values()]), groups.sp_group)
        flat /= groups.sp_world_size
        averaged = dict(
            zip(
                grads,
                (
                    f.view_as(g)
                    for f, g in zip(flat.split([g.numel() for g in grads.values()]), grads.values(), strict=True)
                ),
                strict=True,
            )
        )
        sha = all_gather_object(weights_sha256(model), groups.sp_group)
        tower_rows = all_gather_object(rows, groups.sp_group)
        if dist.get_rank() == 0:
            result = {"loss": loss.item(), "grads": averaged, "weights_sha256": sha, "tower_rows": tower_rows}
            tmp = spec.output + ".tmp"
            torch.save(result, tmp)
            os.replace(tmp, spec.output)
        barrier(groups.sp_group)
    finally:
        dist.destroy_process_group()


def worker_env() -> dict[str, str]:
    """The workers' environment: one thread each, offline, loopback gloo, this copy of hf_longctx importable."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding hf_longctx/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single machine: loopback only
    return env


def launch(spec_path: Path, sp: int, log_path: Path) -> subprocess.Popen:
    """Start torchrun with `sp` workers running `spec_path`, output to `log_path`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp)]
    cmd += ["-m", "hf_longctx.check", "--worker", str(spec_path)]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=worker_env(), start_new_session=os.name == "posix"
        )


def kill(proc: subprocess.Popen, pid_dir: Path) -> None:
    """Stop torchrun (it stops its workers), then SIGKILL whatever of ours is left."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(_GRACE_S)
        except subprocess.TimeoutExpired:
            if os.name == "posix":
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    # torchrun starts every worker in its own session: kill those it could not stop (only
    # processes still running this check's worker command, never a recycled pid).
    for pid_file in pid_dir.glob("rank*.pid"):
        try:
            pid = int(pid_file.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if str(pid_dir).encode() in cmdline:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass


def log_tail(path: Path) -> str:
    """The last lines of a worker log, indented for the report."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    | " + line for line in lines[-_LOG_TAIL_LINES:])

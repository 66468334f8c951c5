"""`hf-longctx check`: is Ulysses sequence parallelism exact for this model architecture?

`run(args)` builds a small random-init float32 copy of a local config, runs one SP=K training step
in K gloo ranks launched by torchrun (`python -m hf_longctx.check --worker SPEC` is their entry),
recomputes the same step at SP=1 in this process and compares the loss and every gradient.
The hidden `--inject-fault` flag breaks the SP run on purpose: a self-test of the checker itself.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

EXIT_PASS, EXIT_FAIL, EXIT_INVALID = 0, 1, 2
MAX_VOCAB = 512
SEED = 0
# Self-test faults of the checker. "skip-positions": workers feed shard-local position ids
# (0..S/K-1 on every rank) instead of the global ones, which breaks RoPE and the causal mask.
FAULTS = ("skip-positions",)
TOP_K = 5
_GRACE_S = 10.0
_LOG_TAIL_LINES = 40
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
        fault: one of `FAULTS` to break the run on purpose, or None.
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


@dataclass
class StepResult:
    """One training step's outcome: loss, per-parameter gradients, weight fingerprint."""

    loss: float
    grads: dict[str, torch.Tensor]
    weights_sha256: str


@dataclass
class Comparison:
    """SP run vs SP=1 reference."""

    loss_sp: float
    loss_ref: float
    loss_rel: float
    grad_errors: list[tuple[str, float]]  # (parameter, max|g_sp - g_ref| / max|g_ref|), worst first

    @property
    def worst_grad(self) -> float:
        """The largest relative gradient error (0 when the model has no parameters)."""
        return self.grad_errors[0][1] if self.grad_errors else 0.0


# ---------------------------------------------------------------------------------------------
# Model, batch and one step: shared by the parent (reference) and the workers.


def resolve_config_path(model: str) -> Path:
    """The local `config.json` that `model` names (a folder holding one, or the file itself).

    Args:
        model: a folder with `config.json`, or a path to a JSON config file.

    Returns:
        The path of the JSON file.

    Raises:
        ValueError: nothing usable at that path (the Hub is never consulted).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file() or path.suffix != ".json":
        raise ValueError(
            f"--model {model!r}: no config.json there. Pass a local folder holding config.json or the "
            "config.json file itself (the Hub is never used; download the config first)."
        )
    return path


def load_config(model: str) -> Any:
    """Load a local config with `AutoConfig` (offline).

    Args:
        model: see `resolve_config_path`.

    Returns:
        The `PreTrainedConfig`.

    Raises:
        ValueError: missing or unreadable config, or an architecture transformers does not know.
    """
    from transformers import AutoConfig

    path = resolve_config_path(model)
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise ValueError(f"--model {model!r}: cannot load {path}: {exc}") from exc


def head_counts(config: Any) -> tuple[int, int]:
    """`(num_attention_heads, num_key_value_heads)` of a (text) config; kv defaults to the query heads.

    Raises:
        ValueError: the config declares no attention heads (Ulysses splits attention heads).
    """
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    if not heads:
        raise ValueError(
            f"{type(config).__name__} has no num_attention_heads: Ulysses sequence parallelism splits "
            "attention heads, so this architecture cannot be checked."
        )
    kv = getattr(text, "num_key_value_heads", None)
    return int(heads), int(kv) if kv else int(heads)


def shrink_config(config: Any, *, layers: int, hidden: int, min_positions: int, attn: str) -> tuple[Any, list[str]]:
    """A small copy of `config` for the check: same attention heads, fewer layers, small vocab.

    Args:
        config: the original `PreTrainedConfig` (not modified).
        layers: `num_hidden_layers` of the copy.
        hidden: new hidden size (0 keeps it); head counts are kept, `head_dim = hidden / heads`
            and `intermediate_size = 2 * hidden`. Kept unchanged when `hidden` is not a multiple of
            `2 * num_attention_heads` (RoPE needs an even head dimension).
        min_positions: `max_position_embeddings` is raised to at least this.
        attn: attention implementation recorded in the copy.

    Returns:
        The shrunk copy and human-readable notes on what was kept or changed.
    """
    config = copy.deepcopy(config)
    text = config.get_text_config()
    notes: list[str] = []
    old_layers = int(text.num_hidden_layers)
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list) and len(text.layer_types) > layers:
        text.layer_types = text.layer_types[:layers]
    notes.append(f"layers {old_layers} -> {layers}")

    heads, _ = head_counts(config)
    if hidden:
        if hidden % (2 * heads) == 0:
            notes.append(f"hidden {text.hidden_size} -> {hidden} (head_dim {hidden // heads})")
            text.hidden_size = hidden
            text.head_dim = hidden // heads
            if hasattr(text, "intermediate_size"):
                text.intermediate_size = 2 * hidden
        else:
            notes.append(f"--hidden {hidden} is not a multiple of 2 x {heads} heads: kept hidden {text.hidden_size}")

    vocab = int(text.vocab_size)
    if vocab > MAX_VOCAB:
        text.vocab_size = MAX_VOCAB
        notes.append(f"vocab {vocab} -> {MAX_VOCAB}")
        for holder in {id(config): config, id(text): text}.values():
            for key in _TOKEN_ID_KEYS:
                value = getattr(holder, key, None)
                if isinstance(value, int) and value >= MAX_VOCAB:
                    setattr(holder, key, None)
                elif isinstance(value, list):
                    kept = [v for v in value if v < MAX_VOCAB]
                    setattr(holder, key, kept or None)

    if getattr(text, "max_position_embeddings", None) is not None and text.max_position_embeddings < min_positions:
        text.max_position_embeddings = min_positions
    for key, value in text.to_dict().items():
        # dropout and router/input jitter noise draw random numbers in train mode: SP and the reference
        # would draw different ones
        random_in_training = "dropout" in key or key.endswith("pdrop") or "jitter" in key
        if random_in_training and isinstance(value, float) and value != 0.0:
            setattr(text, key, 0.0)
            notes.append(f"{key} {value} -> 0")
    text.use_cache = False
    config.use_cache = False
    config._attn_implementation = attn
    return config, notes


def build_model(config_dir: str | Path, attn: str, seed: int) -> torch.nn.Module:
    """The random-init float32 causal LM of `config_dir`, identical for equal seeds, in train mode.

    Raises:
        ValueError: transformers has no causal-LM class for this config.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ValueError(
            f"{type(config).__name__} (model_type {config.model_type!r}) has no causal-LM class in "
            "transformers (AutoModelForCausalLM); hf-longctx check supports decoder-only causal LMs."
        ) from None
    return model.float().train()


def weights_sha256(model: torch.nn.Module) -> str:
    """A fingerprint of every parameter's bytes (name order), to prove identical weights."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def make_batch(vocab_size: int, seq_len: int, batch_size: int, packed: bool, seed: int) -> dict[str, torch.Tensor]:
    """The deterministic full batch of the check.

    Row 0 has the labels of its first half (plus one token) set to -100, so at SP>=2 rank 0's
    shard has no valid label at all; with `packed`, every row holds three documents whose
    position ids restart at 0.

    Args:
        vocab_size: token ids are drawn from `[1, vocab_size)`.
        seq_len: sequence length (odd lengths exercise padding).
        batch_size: rows.
        packed: add restarting `position_ids` for three documents per row.
        seed: generator seed.

    Returns:
        `input_ids`, `labels` and, when packed, `position_ids`, all `[batch_size, seq_len]` int64.
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (batch_size, seq_len), generator=gen)
    labels = ids.clone()
    labels[0, : (seq_len + 1) // 2 + 1] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        third = seq_len // 3
        lengths = (third, third, seq_len - 2 * third)
        pos = torch.cat([torch.arange(n) for n in lengths])
        batch["position_ids"] = pos.expand(batch_size, seq_len).clone()
    return batch


def _step(model: torch.nn.Module, shard: dict[str, Any], groups: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward, SP loss and backward on one shard; returns the loss and this rank's gradients."""
    from .loss import sequence_parallel_loss

    model.zero_grad(set_to_none=True)
    shift_labels = shard.pop("shift_labels")
    logits = model(**shard).logits
    loss = sequence_parallel_loss(logits, shift_labels, groups)
    loss.backward()
    return loss.detach(), _take_grads(model)


def _take_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter's gradient (zeros where none), then clear them."""
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return grads


def reference_step(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> StepResult:
    """The SP=1 reference: the plain model (hf_longctx not enabled), one forward per document.

    The model builds its own masks (causal, sliding window, chunked), so SP is compared with what
    the model itself computes, not with the library's single-rank path. A packed row is run as
    separate documents, each with positions from 0, and the logits are concatenated: the ground
    truth packing stands for, whether or not the model's own mask code detects packed rows (some
    ignore `position_ids` and would attend across documents).
    """
    from .data.sharding import document_starts, shard_batch_for_rank
    from .groups import SequenceParallelGroups
    from .loss import sequence_parallel_loss

    full = shard_batch_for_rank(batch, 0, 1)
    ids, pos, shift_labels = full["input_ids"], full["position_ids"], full["shift_labels"]
    starts = document_starts(pos)
    if not bool((starts == starts[:1]).all()):
        raise ValueError("reference_step: every row must share one document layout (see make_batch).")
    bounds = [*torch.nonzero(starts[0]).flatten().tolist(), ids.shape[1]]
    model.zero_grad(set_to_none=True)
    segments = zip(bounds[:-1], bounds[1:], strict=True)
    logits = torch.cat([model(input_ids=ids[:, s:e], position_ids=pos[:, s:e]).logits for s, e in segments], dim=1)
    loss = sequence_parallel_loss(logits, shift_labels, SequenceParallelGroups.single())
    loss.backward()
    return StepResult(loss.item(), _take_grads(model), weights_sha256(model))


def valid_labels_per_rank(batch: Mapping[str, torch.Tensor], sp: int, layout: str = "contiguous") -> list[int]:
    """Number of valid shift labels in each SP rank's shard (pure; what the workers will see)."""
    from .data.sharding import IGNORE_INDEX, shard_batch_for_rank

    shards = [shard_batch_for_rank(batch, r, sp, layout=layout) for r in range(sp)]
    return [int((shard["shift_labels"] != IGNORE_INDEX).sum()) for shard in shards]


# ---------------------------------------------------------------------------------------------
# Worker side (inside torchrun).


def worker_main(spec_path: str) -> None:
    """One torchrun rank: SP loss and gradients averaged over the group; rank 0 writes them.

    Args:
        spec_path: the JSON `WorkerSpec` written by the parent.

    Raises:
        ValueError: from the library, e.g. an unsupported attention implementation.
    """
    import torch.distributed as dist

    from .attention.registry import enable_sequence_parallel
    from .data.loader import shard_batch
    from .groups import SequenceParallelGroups

    spec = WorkerSpec.load(spec_path)
    Path(spec.pid_dir, f"rank{os.environ.get('RANK', '0')}.pid").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        groups = SequenceParallelGroups.build(dist.get_world_size())
        model = build_model(spec.config_dir, spec.attn, spec.seed)
        batch = make_batch(
            model.config.get_text_config().vocab_size, spec.seq_len, spec.batch_size, spec.packed, spec.seed
        )
        options = {"backend": spec.backend, "ulysses_degree": spec.ulysses_degree, "ring_variant": spec.ring_variant}
        with enable_sequence_parallel(model, groups, **options):
            shard = shard_batch(batch, groups)
            if spec.fault == "skip-positions":
                bs, local = shard["input_ids"].shape
                shard["position_ids"] = torch.arange(local).expand(bs, local).clone()
            loss, grads = _step(model, shard, groups)
        flat = torch.cat([g.reshape(-1) for g in grads.values()])
        dist.all_reduce(flat, group=groups.sp_group)  # what a DP engine does: average over ranks
        flat /= groups.sp_world_size
        averaged, offset = {}, 0
        for name, g in grads.items():
            averaged[name] = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()
        sha = [None] * dist.get_world_size()
        dist.all_gather_object(sha, weights_sha256(model), group=groups.sp_group)
        if dist.get_rank() == 0:
            result = {"loss": loss.item(), "grads": averaged, "weights_sha256": sha}
            tmp = spec.output + ".tmp"
            torch.save(result, tmp)
            os.replace(tmp, spec.output)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Comparison and report.


def compare(sp_loss: float, sp_grads: Mapping[str, torch.Tensor], ref: StepResult) -> Comparison:
    """Relative loss difference and per-parameter `max|g_sp - g_ref| / max|g_ref|`, worst first.

    Raises:
        ValueError: the two runs do not have the same parameter names and shapes.
    """
    if sp_grads.keys() != ref.grads.keys():
        raise ValueError(f"SP and reference parameters differ: {sorted(set(sp_grads) ^ set(ref.grads))[:5]}")
    errors = []
    for name, r in ref.grads.items():
        g = sp_grads[name]
        if g.shape != r.shape:
            raise ValueError(f"{name}: SP gradient {tuple(g.shape)} vs reference {tuple(r.shape)}")
        diff = float((g.double() - r.double()).abs().max()) if r.numel() else 0.0
        scale = float(r.double().abs().max()) if r.numel() else 0.0
        if math.isnan(diff):
            err = math.inf
        else:
            err = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        errors.append((name, err))
    errors.sort(key=lambda item: item[1], reverse=True)
    denom = abs(ref.loss) if ref.loss != 0 else 1.0
    loss_rel = abs(sp_loss - ref.loss) / denom
    if not math.isfinite(sp_loss):
        loss_rel = math.inf
    return Comparison(sp_loss, ref.loss, loss_rel, errors)


def verdict(cmp: Comparison, sp: int, tol_loss: float, tol_grad: float, label: str) -> tuple[bool, str]:
    """`(passed, line)`: the final "PASS: ..." or "FAIL: <reason>" line of the report."""
    problems = []
    if not cmp.loss_rel <= tol_loss:
        problems.append(f"loss relative difference {cmp.loss_rel:.2e} > {tol_loss:.0e}")
    if not cmp.worst_grad <= tol_grad:
        bad = [name for name, err in cmp.grad_errors if not err <= tol_grad]
        problems.append(
            f"{len(bad)} of {len(cmp.grad_errors)} gradients differ by more than {tol_grad:.0e} "
            f"(worst {cmp.worst_grad:.2e}: {', '.join(bad[:3])})"
        )
    if problems:
        return False, f"FAIL: SP={sp} is not exact for {label}: " + "; ".join(problems)
    return True, (
        f"PASS: SP={sp} matches SP=1 for {label} (loss rel {cmp.loss_rel:.1e} <= {tol_loss:.0e}, "
        f"grads rel {cmp.worst_grad:.1e} <= {tol_grad:.0e} over {len(cmp.grad_errors)} parameters)"
    )


# ---------------------------------------------------------------------------------------------
# The CLI command.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `check` options to `parser`."""
    parser.add_argument("--model", required=True, help="local folder with config.json, or a config.json file")
    parser.add_argument("--sp", type=int, required=True, help="sequence-parallel size K (K torchrun ranks)")
    parser.add_argument(
        "--seq-len", type=int, default=67, help="tokens per row; odd lengths exercise padding (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="rows in the batch (default: %(default)s)")
    parser.add_argument(
        "--layers", type=int, default=2, help="num_hidden_layers of the test copy (default: %(default)s)"
    )
    parser.add_argument(
        "--hidden", type=int, default=0, help="shrink hidden size to this (heads kept; 0 keeps the original)"
    )
    parser.add_argument(
        "--attn", choices=("sdpa", "eager"), default="sdpa", help="attention kernel (default: %(default)s)"
    )
    parser.add_argument("--packed", action="store_true", help="pack 3 documents per row (restarting positions)")
    parser.add_argument(
        "--backend",
        choices=("ulysses", "ring", "hybrid", "auto"),
        default="ulysses",
        help="SP backend under test (default: %(default)s)",
    )
    parser.add_argument(
        "--ulysses-degree", type=int, default=None, help="hybrid/auto: Ulysses degree (default: chosen)"
    )
    parser.add_argument(
        "--ring-variant",
        choices=("p2p", "allgather"),
        default=None,
        help="ring/hybrid variant (default: p2p; auto chooses)",
    )
    parser.add_argument(
        "--tolerance-loss", type=float, default=1e-5, help="max relative loss difference (default: %(default)s)"
    )
    parser.add_argument(
        "--tolerance-grad", type=float, default=1e-4, help="max relative gradient difference (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before the SP run is killed (default: %(default)s)"
    )
    # Self-test of the checker: deliberately break the SP run; the check must then FAIL.
    parser.add_argument("--inject-fault", choices=FAULTS, default=None, help=argparse.SUPPRESS)


def _validate(args: argparse.Namespace) -> None:
    if args.sp < 1:
        raise ValueError(f"--sp must be >= 1, got {args.sp}.")
    for flag, value, low in (
        ("--seq-len", args.seq_len, 4),
        ("--batch-size", args.batch_size, 1),
        ("--layers", args.layers, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    if args.hidden < 0:
        raise ValueError(f"--hidden must be >= 0 (0 keeps the model's), got {args.hidden}.")
    for flag, value in (
        ("--tolerance-loss", args.tolerance_loss),
        ("--tolerance-grad", args.tolerance_grad),
        ("--timeout", args.timeout),
    ):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}.")


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single machine: loopback only
    return env


def _launch(spec_path: Path, sp: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp)]
    cmd += ["-m", "hf_longctx.check", "--worker", str(spec_path)]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(), start_new_session=os.name == "posix"
        )


def _kill(proc: subprocess.Popen, pid_dir: Path) -> None:
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


def _log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join("    | " + line for line in lines[-_LOG_TAIL_LINES:])


def run(args: argparse.Namespace, emit: Callable[[str], None] | None = None) -> int:
    """Run `hf-longctx check` and print its report.

    Args:
        args: the parsed options of `add_arguments`.
        emit: where report lines go (default: print to stdout).

    Returns:
        0 on PASS; 1 on FAIL (above tolerance, the SP run crashed or timed out); 2 on invalid
        input (bad options, no config, unsupported model, heads not divisible by `--sp`), in
        which case nothing is launched.
    """
    from .attention.backends import resolve_backend
    from .attention.hybrid import check_ring_model
    from .attention.registry import enable_sequence_parallel
    from .data.layout import pad_multiple
    from .groups import SequenceParallelGroups

    out = emit or (lambda line: print(line, flush=True))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sp = args.sp
    with tempfile.TemporaryDirectory(prefix="hf_longctx_check_") as tmp_name:
        tmp = Path(tmp_name)
        try:
            _validate(args)
            original = load_config(args.model)
            heads, kv_heads = head_counts(original)
            # What the workers will run (auto resolved as on one host of sp ranks): raises for bad heads/options.
            backend = resolve_backend(
                args.backend,
                heads,
                kv_heads,
                sp,
                ulysses_degree=args.ulysses_degree,
                ring_variant=args.ring_variant,
                ranks_per_node=sp,
                link="host",
            )
            padded = args.seq_len + (-args.seq_len % pad_multiple(backend.layout, sp))
            config, notes = shrink_config(
                original, layers=args.layers, hidden=args.hidden, min_positions=padded, attn=args.attn
            )
            config.save_pretrained(tmp / "model")
            model = build_model(tmp / "model", args.attn, SEED)
            # Validates the kernel and the model type the way the workers will, before launching.
            enable_sequence_parallel(model, SequenceParallelGroups.single()).remove()
            if backend.name != "ulysses":
                check_ring_model(model.config.get_text_config(), model)
        except ValueError as exc:
            out(f"INVALID: {exc}")
            return EXIT_INVALID

        text = model.config.get_text_config()
        label = type(model).__name__
        batch = make_batch(text.vocab_size, args.seq_len, args.batch_size, args.packed, SEED)
        n_params = sum(p.numel() for p in model.parameters())
        out(f"hf-longctx check: {label} ({config.model_type}) from {resolve_config_path(args.model)}")
        out(
            f"  test copy: {text.num_hidden_layers} layers, hidden {text.hidden_size}, {heads} heads / "
            f"{kv_heads} kv heads, head_dim {getattr(text, 'head_dim', None) or text.hidden_size // heads}, "
            f"vocab {text.vocab_size}, {n_params:,} params, float32, attn {args.attn}, seed {SEED}"
        )
        out(f"  shrunk: {'; '.join(notes)}")
        out(
            f"  batch: {args.batch_size} x {args.seq_len} tokens (padded to {padded}, {padded // sp} per rank), "
            f"packed: {'3 docs/row' if args.packed else 'no'}, valid labels per SP rank: "
            f"{valid_labels_per_rank(batch, sp, backend.layout)}"
        )
        out(
            f"  backend: {backend.name} (Ulysses degree {backend.ulysses_degree} x ring {backend.ring_size}, "
            f"{backend.layout} layout{', ' + backend.ring_variant if backend.ring_size > 1 else ''})"
            + (f"; {args.backend}: {backend.reason}" if args.backend == "auto" else "")
        )
        if args.inject_fault:
            out(f"  SELF-TEST: fault {args.inject_fault!r} injected into the SP run; the check must FAIL")

        spec = WorkerSpec(
            config_dir=str(tmp / "model"),
            attn=args.attn,
            seed=SEED,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            packed=args.packed,
            output=str(tmp / "sp_result.pt"),
            pid_dir=str(tmp),
            fault=args.inject_fault,
            backend=args.backend,
            ulysses_degree=args.ulysses_degree,
            ring_variant=args.ring_variant,
        )
        spec.save(tmp / "spec.json")
        log_path = tmp / "torchrun.log"
        start = time.monotonic()
        proc = _launch(tmp / "spec.json", sp, log_path)
        try:
            ref = reference_step(model, batch)  # overlaps with torchrun's start-up
            ref_s = time.monotonic() - start
            try:
                code = proc.wait(max(0.0, args.timeout - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                _kill(proc, tmp)
                out(_log_tail(log_path))
                out(f"FAIL: timed out: the SP={sp} run did not finish within {args.timeout:g} s (killed)")
                return EXIT_FAIL
        finally:
            if proc.poll() is None:  # an exception in the reference or Ctrl-C: leave nothing behind
                _kill(proc, tmp)
        sp_s = time.monotonic() - start
        result_path = Path(spec.output)
        if code != 0 or not result_path.exists():
            out(_log_tail(log_path))
            out(f"FAIL: the SP={sp} run failed (torchrun exit code {code}); its output is above")
            return EXIT_FAIL

        result = torch.load(result_path, weights_only=True)
        out(f"  SP={sp} run (torchrun, gloo): {sp_s:.1f} s; SP=1 reference (in process): {ref_s:.1f} s")
        if any(sha != ref.weights_sha256 for sha in result["weights_sha256"]):
            out("FAIL: the SP workers and the reference built different weights (seeded init is not deterministic)")
            return EXIT_FAIL
        try:
            cmp = compare(result["loss"], result["grads"], ref)
        except ValueError as exc:
            out(f"FAIL: {exc}")
            return EXIT_FAIL
        out(f"  loss   SP={sp} {cmp.loss_sp:.9f}   SP=1 {cmp.loss_ref:.9f}   rel diff {cmp.loss_rel:.2e}")
        out(f"  grads  worst of {len(cmp.grad_errors)} parameters, max|g_sp - g_ref| / max|g_ref|:")
        for name, err in cmp.grad_errors[:TOP_K]:
            out(f"    {err:.2e}  {name}")
        passed, line = verdict(cmp, sp, args.tolerance_loss, args.tolerance_grad, label)
        out(line)
        return EXIT_PASS if passed else EXIT_FAIL


def _module_main(argv: list[str] | None = None) -> int:
    """`python -m hf_longctx.check`: the torchrun worker (`--worker SPEC`) or the check itself."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--worker":
        from torch.distributed.elastic.multiprocessing.errors import record

        record(worker_main)(argv[1])  # a worker's traceback then heads torchrun's failure summary
        return 0
    parser = argparse.ArgumentParser(prog="python -m hf_longctx.check", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_module_main())

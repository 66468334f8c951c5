"""Measurements of the SP path: collective counters, peak memory, tokens/s and model TFLOP/s.

`record_collectives()` is the main entry: inside it every collective issued by `hf_longctx.distributed.comm` is
counted (calls, bytes sent to other ranks, wall time). Outside it the only cost is one `ContextVar`
read per collective. `SPMetricsCallback` adds all of it to the Trainer's log lines; it is off
unless added to a Trainer.
"""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback


@dataclass
class CollectiveStat:
    calls: int = 0
    bytes_sent: int = 0  # to other ranks, from this rank
    seconds: float = 0.0


@dataclass
class CollectiveStats:
    """Per-collective counters of this rank."""

    ops: dict[str, CollectiveStat] = field(default_factory=dict)

    def add(self, op: str, bytes_sent: int, seconds: float) -> None:
        stat = self.ops.setdefault(op, CollectiveStat())
        stat.calls += 1
        stat.bytes_sent += bytes_sent
        stat.seconds += seconds

    def total_bytes(self, prefix: str = "") -> int:
        return sum(s.bytes_sent for op, s in self.ops.items() if op.startswith(prefix))

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {op: vars(s).copy() for op, s in self.ops.items()}


_RECORDER: ContextVar[CollectiveStats | None] = ContextVar("hf_longctx_collectives", default=None)


@contextlib.contextmanager
def record_collectives(stats: CollectiveStats | None = None) -> Iterator[CollectiveStats]:
    """Count the collectives `hf_longctx.distributed.comm` issues inside the block (this thread/context)."""
    stats = stats if stats is not None else CollectiveStats()
    token = _RECORDER.set(stats)
    try:
        yield stats
    finally:
        _RECORDER.reset(token)


def active_recorder() -> CollectiveStats | None:
    """The recorder of the current context (autograd functions keep it for their backward).

    None under `torch.compile`: counters are host-side Python state that the compiler cannot trace
    (reading the context variable alone would break the graph), so compiled regions are not counted.
    """
    if torch.compiler.is_compiling():
        return None
    return _RECORDER.get()


@contextlib.contextmanager
def timed_collective(
    op: str, tensor: torch.Tensor, share_sent: float, stats: CollectiveStats | None = None
) -> Iterator[None]:
    """Time one collective and add `tensor.nbytes * share_sent` bytes to `stats` or the active recorder.

    Backward passes may run on autograd's device threads, where the context variable is unset, so
    autograd functions pass the recorder they saw in forward as `stats`. On CUDA the time is the
    host-side time unless the caller synchronises; on CPU/gloo it is the wall time.
    """
    stats = stats if stats is not None else active_recorder()
    if stats is None:
        yield
        return
    start = time.perf_counter()
    yield
    stats.add(op, int(tensor.numel() * tensor.element_size() * share_sent), time.perf_counter() - start)


def ulysses_min_bytes(num_heads: int, num_kv_heads: int, head_dim: int, seq_len: int, sp: int, elem: int) -> float:
    """Theoretical minimum bytes one rank sends per layer forward in Ulysses (q, k, v in; output back)."""
    return (2 * num_heads * head_dim + 2 * num_kv_heads * head_dim) * (seq_len / sp) * (sp - 1) / sp * elem


def causal_lm_flops_per_token(num_params: int, num_layers: int, num_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 x parameters plus causal attention (half of the S x S score matrix).

    Attention forward per layer and token: QK^T and PV over on average S/2 keys, 2 FLOPs per multiply-add,
    i.e. 2 * 2 * (S / 2) * H * d; backward is twice the forward.
    """
    return 6 * num_params + 3 * num_layers * 2 * seq_len * num_heads * head_dim


class PeakMemorySampler:
    """Peak resident memory of this process during a block, sampled by a background thread.

    `ru_maxrss` only ever grows, so per-step peaks on CPU need sampling; on CUDA use the allocator's
    `max_memory_allocated` instead (`peak_cuda_bytes`).
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self.start = interval, 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def __enter__(self) -> PeakMemorySampler:
        self.start = self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.rss())


class SPMetricsCallback(TrainerCallback):
    """Adds SP measurements to every training log line (off unless added to a Trainer).

    Logged: `sp_collective_calls`, `sp_collective_mbytes` (sent by this rank), `sp_collective_seconds`,
    `peak_memory_mb` (CUDA allocator peak, or the process peak RSS on CPU) and `model_tflops`
    (model FLOPs per second, causal attention counted) since the previous log line.
    """

    def __init__(self) -> None:
        self.stats = CollectiveStats()
        self._token: Any = None
        self._last = (0.0, 0.0)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._token = _RECORDER.set(self.stats)
        self._last = (time.perf_counter(), 0.0)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._token is not None:
            _RECORDER.reset(self._token)
            self._token = None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, model: Any = None, **kw: Any):
        if logs is None or "loss" not in logs:
            return
        ops = self.stats.ops.values()
        logs["sp_collective_calls"] = sum(s.calls for s in ops)
        logs["sp_collective_mbytes"] = round(sum(s.bytes_sent for s in ops) / 2**20, 3)
        logs["sp_collective_seconds"] = round(sum(s.seconds for s in ops), 4)
        if torch.cuda.is_available():
            logs["peak_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        else:
            logs["peak_memory_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        tokens = float(logs.get("num_tokens", getattr(state, "num_input_tokens_seen", 0)) or 0)
        now = time.perf_counter()
        if model is not None and tokens > self._last[1] and now > self._last[0]:
            config = model.config.get_text_config()
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            seq = args.max_length if getattr(args, "max_length", None) else 2048
            per_token = causal_lm_flops_per_token(
                sum(p.numel() for p in model.parameters()),
                config.num_hidden_layers,
                config.num_attention_heads,
                head_dim,
                seq,
            )
            logs["model_tflops"] = round(per_token * (tokens - self._last[1]) / (now - self._last[0]) / 1e12, 6)
        self._last = (now, tokens)

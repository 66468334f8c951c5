"""Trainer callbacks: throughput in the log lines.

`ThroughputCallback` adds `tokens_per_second` (tokens consumed since the previous log line divided
by the wall time between them) to every training log line, from TRL's `num_tokens` metric or
Trainer's `num_input_tokens_seen`. It costs one clock read per log line.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback


class ThroughputCallback(TrainerCallback):
    """Add `tokens_per_second` to the training logs the progress bar prints."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._last = (time.perf_counter(), 0.0)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is None or self._last is None or "loss" not in logs:
            return
        tokens = logs.get("num_tokens", getattr(state, "num_input_tokens_seen", 0)) or 0
        now = time.perf_counter()
        last_time, last_tokens = self._last
        if tokens > last_tokens and now > last_time:
            logs["tokens_per_second"] = round((tokens - last_tokens) / (now - last_time), 1)
        self._last = (now, float(tokens))

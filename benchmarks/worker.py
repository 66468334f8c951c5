"""One measured training run of the benchmark: `run(rank, world_size, spec)` in every rank of a
`benchmarks._harness` job. `spec["impl"]` picks the SP implementation, everything else is shared:

- "hf_longctx": `parallelism_config=hf_longctx.ParallelismConfig(sp_size=P, **spec.get("sp_options", {}))`
                (Ulysses by default; `benchmarks.backends` passes ring / hybrid options);
- "upstream":   `accelerate.parallelism_config.ParallelismConfig(sp_size=P, sp_backend="deepspeed")` with
                `sp_handler.sp_attn_implementation` set to the model's kernel (DeepSpeed ALST Ulysses);
- "none":       no SP (the SP=1 baseline, normally one process).

All three train the same random-init model on the same random tokens with the HF `Trainer` and DeepSpeed
ZeRO-1 as the data-parallel engine (on CPU through the `PartialState(backend="gloo")` +
`use_configured_state` route: without it accelerate sees one process per rank on CPU and duplicates data).
A `TrainerCallback` measures every optimizer step between `on_step_begin` and `on_step_end` (the batch is
already loaded then):

- `step_s`: wall time of the step (CUDA synchronised at both ends on GPU); `iter_s`: from the previous
  step's end to this one's (adds data loading, which is where the upstream loader all-gathers batches);
- memory: `before` = resident memory at `on_step_begin`, `peak` = the process high-water mark during the
  step, reset at `on_step_begin` through `/proc/self/clear_refs` (CPU; RSS) or the allocator peak
  (`torch.cuda.max_memory_allocated`, GPU). `peak - before` is the activation + transient memory of the
  step: after the warm-up step the weights, the optimizer state and DeepSpeed's buffers already exist
  before the step, while activations, gradients and temporaries are created inside it;
- collectives: `torch.distributed.all_to_all_single` (and, for information, `all_gather`,
  `all_gather_into_tensor`, `all_reduce`, `reduce_scatter_tensor`, `broadcast`) are wrapped in this process
  for both implementations: calls, bytes this rank sends to other ranks, and wall time inside the call
  (CUDA events on GPU). For hf_longctx, `hf_longctx.instrument.record_collectives()` numbers are added.
- `spec["op_profile"]` (CPU): one extra step after the measured ones runs under `torch.profiler`; its self
  CPU time is split by `report.categorize_ops` into attention kernel, matmul, communication and other. That
  step is not in `steps`, so the profiler's overhead never reaches the medians.
"""

from __future__ import annotations

import inspect
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

T_START = time.time()  # wall clock at worker start (before torch is imported)
TIMELINE: dict[str, float] = {"worker_start": T_START}


def mark(name: str) -> None:
    TIMELINE[name] = time.time()


# What one all_to_all_single / other collective sends to other ranks, given its bytes `n` and group size `ws`.
_VOLUME: dict[str, tuple[str, Callable[[int, int], float]]] = {
    "all_gather": ("tensor", lambda n, ws: n * (ws - 1)),
    "all_gather_into_tensor": ("input_tensor", lambda n, ws: n * (ws - 1)),
    "all_reduce": ("tensor", lambda n, ws: 2 * n * (ws - 1) / ws),
    "reduce_scatter_tensor": ("input", lambda n, ws: n * (ws - 1) / ws),
    "broadcast": ("tensor", lambda n, ws: n),
}
A2A = "all_to_all_single"


class CommCounter:
    """Process-wide counters of the collectives issued through `torch.distributed` (any thread).

    Unlike a ContextVar this also sees collectives run by autograd's device threads (CUDA backward).
    """

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.totals: dict[str, list[float]] = {}  # op -> [calls, bytes sent to other ranks, seconds]
        self._pending: list[tuple[str, Any, Any]] = []  # CUDA events resolved in flush()

    def install(self) -> None:
        import torch.distributed as dist

        for op in (A2A, *_VOLUME):
            original = getattr(dist, op)
            setattr(dist, op, self._wrap(op, original, inspect.signature(original)))

    def _wrap(self, op: str, original: Callable[..., Any], signature: inspect.Signature) -> Callable[..., Any]:
        import torch
        import torch.distributed as dist

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            ws = dist.get_world_size(group)
            if op == A2A:
                x = bound["input"]
                n = x.numel() * x.element_size()
                splits = bound.get("input_split_sizes")
                if splits:
                    me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
                    sent = n - n * splits[me] / x.shape[0]
                else:
                    sent = n * (ws - 1) / ws
            else:
                key, volume = _VOLUME[op]
                x = bound[key]
                sent = volume(x.numel() * x.element_size(), ws)
            on_cuda = self.cuda and x.is_cuda
            if on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            seconds = time.perf_counter() - t0
            stat = self.totals.setdefault(op, [0, 0.0, 0.0])
            stat[0] += 1
            stat[1] += sent
            if on_cuda:
                end.record()
                self._pending.append((op, start, end))
            else:
                stat[2] += seconds
            return out

        wrapper.__wrapped__ = original
        return wrapper

    def flush(self) -> None:
        """Add the elapsed time of recorded CUDA events (call after `torch.cuda.synchronize()`)."""
        for op, start, end in self._pending:
            self.totals[op][2] += start.elapsed_time(end) / 1000
        self._pending.clear()

    def snapshot(self) -> dict[str, list[float]]:
        return {op: list(v) for op, v in self.totals.items()}


def _diff(after: dict[str, list[float]], before: dict[str, list[float]]) -> dict[str, list[float]]:
    out = {}
    for op, (calls, sent, secs) in after.items():
        b = before.get(op, [0, 0.0, 0.0])
        if calls - b[0]:
            out[op] = [int(calls - b[0]), sent - b[1], secs - b[2]]
    return out


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.M).group(1))


class StepMemory:
    """Per-step peak memory: RSS high-water mark (CPU) or the CUDA allocator peak (GPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.process_peak = 0
        self._sampler = None
        self.method = "cuda_max_memory_allocated" if cuda else "proc_clear_refs_VmHWM"
        if not cuda:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:  # not allowed here: sample RSS from a thread instead
                self.method = "rss_sampler_thread"

    def begin(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.process_peak = max(self.process_peak, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        if self.method == "rss_sampler_thread":
            from hf_longctx.instrument import PeakMemorySampler

            self._sampler = PeakMemorySampler().__enter__()
            return self._sampler.start
        self.process_peak = max(self.process_peak, _proc_status_kib("VmHWM") * 1024)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        return _proc_status_kib("VmRSS") * 1024

    def end(self) -> int:
        import torch

        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
        elif self._sampler is not None:
            self._sampler.__exit__(None, None, None)
            peak, self._sampler = self._sampler.peak, None
        else:
            peak = _proc_status_kib("VmHWM") * 1024
        self.process_peak = max(self.process_peak, peak)
        return peak


def _op_events(prof: Any) -> list[tuple[float, list[str]]]:
    """Per profiler event: self CPU seconds and the names of the event and its ancestors, innermost first."""
    out = []
    for ev in prof.events():
        chain, node = [], ev
        while node is not None:
            chain.append(node.name)
            node = node.cpu_parent
        out.append((ev.self_cpu_time_total / 1e6, chain))
    return out


def _make_callback(counter: CommCounter, memory: StepMemory, hf_stats: Any, cuda: bool, profile_step: int | None):
    import torch
    from transformers import TrainerCallback

    from benchmarks.report import categorize_ops

    class StepRecorder(TrainerCallback):
        """Records every step; step number `profile_step` (0-based) instead runs under `torch.profiler`."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.op_profile: dict[str, float] | None = None
            self._t0 = self._last_end = 0.0
            self._before: dict[str, Any] = {}
            self._seen = 0
            self._prof: Any = None

        def _hf(self) -> tuple[float, float, float]:
            if hf_stats is None:
                return (0, 0.0, 0.0)
            a2a = hf_stats.ops.get("all_to_all")
            return (a2a.calls, a2a.bytes_sent, a2a.seconds) if a2a else (0, 0.0, 0.0)

        def _hf_ops(self) -> dict[str, list[float]]:
            # every op hf_longctx counts (ring_p2p, ring_all_gather, ... besides all_to_all)
            ops = hf_stats.ops.items() if hf_stats is not None else ()
            return {op: [st.calls, st.bytes_sent, st.seconds] for op, st in ops}

        def on_train_begin(self, args, state, control, **kwargs):
            mark("train_begin")
            self._last_end = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self._seen += 1
            if self._seen - 1 == profile_step:
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._prof.__enter__()
                return
            rss_before = memory.begin()
            if cuda:
                counter.flush()
            self._before = {"comm": counter.snapshot(), "hf": self._hf(), "hf_ops": self._hf_ops(), "mem": rss_before}
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self.op_profile, self._prof = categorize_ops(_op_events(self._prof)), None
                self._last_end = time.perf_counter()
                return
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            peak = memory.end()
            if cuda:
                counter.flush()
            comm = _diff(counter.snapshot(), self._before["comm"])
            hf_after, hf_before = self._hf(), self._before["hf"]
            a2a = comm.pop(A2A, [0, 0.0, 0.0])
            self.steps.append(
                {
                    "step_s": t1 - self._t0,
                    "iter_s": t1 - self._last_end,
                    "mem_before": self._before["mem"],
                    "mem_peak": peak,
                    "act_bytes": peak - self._before["mem"],
                    "a2a_calls": a2a[0],
                    "a2a_bytes": a2a[1],
                    "a2a_s": a2a[2],
                    "hf_a2a_calls": hf_after[0] - hf_before[0],
                    "hf_a2a_bytes": hf_after[1] - hf_before[1],
                    "hf_a2a_s": hf_after[2] - hf_before[2],
                    "other_comm": comm,
                    "hf_ops": _diff(self._hf_ops(), self._before["hf_ops"]),
                }
            )
            self._last_end = t1

    return StepRecorder()


class RandomTokens:
    """`n` rows of `seq_len` random token ids (a map-style dataset, identical on every rank)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int) -> None:
        import torch

        self.ids = torch.randint(1, vocab, (n, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i]}


def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
    """Full rows with labels and position_ids (the upstream DataLoader adapter requires position_ids)."""
    import torch

    ids = torch.stack([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(ids.shape[1]).expand_as(ids).clone()}


def build_model(model_spec: dict[str, Any], attn: str, dtype: str, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_cls, model_cls = classes[model_spec["arch"]]
    config = config_cls(
        vocab_size=model_spec["vocab"],
        hidden_size=model_spec["hidden"],
        intermediate_size=model_spec["intermediate"],
        num_hidden_layers=model_spec["layers"],
        num_attention_heads=model_spec["heads"],
        num_key_value_heads=model_spec["kv_heads"],
        head_dim=model_spec["head_dim"],
        max_position_embeddings=max(model_spec.get("max_positions", 0), 4096),
        attention_dropout=0.0,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(model_spec.get("seed", 0))
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
    try:
        with torch.device(device):  # GPU: build in place, never a full fp32 copy in host memory per rank
            model = model_cls(config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model


def run(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """This rank's per-step records (see the module docstring)."""
    import torch

    mark("torch_imported")
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    cuda = spec["device"] == "cuda"
    counter = CommCounter(cuda=cuda)
    counter.install()  # before accelerate / DeepSpeed / hf_longctx bind any collective
    from accelerate import PartialState
    from transformers import Trainer, TrainingArguments

    mark("transformers_imported")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    impl, sp = spec["impl"], spec["sp"]
    if cuda:
        torch.cuda.set_device(local_rank)
    # DeepSpeed is the DP engine of every run; on CPU accelerate needs a configured gloo state (else it reports one
    # process per rank and duplicates the data).
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="nccl" if cuda else "gloo")

    if impl == "hf_longctx":
        import hf_longctx

        parallelism_config = hf_longctx.ParallelismConfig(sp_size=sp, **spec.get("sp_options", {}))
    elif impl == "upstream":
        from accelerate.parallelism_config import ParallelismConfig

        parallelism_config = ParallelismConfig(sp_size=sp, sp_backend="deepspeed")
        parallelism_config.sp_handler.sp_attn_implementation = spec["attn"]
    elif impl == "none":
        parallelism_config = None
    else:
        raise ValueError(f"unknown impl {impl!r}")
    if impl != "none" and sp != world:
        raise ValueError(f"the benchmark runs SP over the whole world: sp={sp}, world={world}")

    steps = spec["warmup"] + spec["steps"]
    # CPU op breakdown: one extra step after the measured ones, profiled and kept out of the medians.
    profile_step = steps if spec.get("op_profile") and not cuda else None
    steps += profile_step is not None
    ds_config = {
        "zero_optimization": {"stage": spec.get("zero_stage", 1)},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
    }
    out_dir = tempfile.mkdtemp(prefix="hf_longctx_bench_")
    args = TrainingArguments(
        output_dir=out_dir,
        report_to=[],
        per_device_train_batch_size=1,
        max_steps=steps,
        learning_rate=1e-4,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        deepspeed=ds_config,
        accelerator_config={"use_configured_state": True},
        bf16=spec["dtype"] == "bf16",
        activation_checkpointing=spec.get("gradient_checkpointing", False),
        logging_strategy="no",
        save_strategy="no",
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=spec.get("seed", 0),
        disable_tqdm=True,
        parallelism_config=parallelism_config,
    )
    model = build_model(spec["model"], spec["attn"], spec["dtype"], f"cuda:{local_rank}" if cuda else "cpu")
    local_lens: list[int] = []
    model.register_forward_pre_hook(
        lambda m, a, kw: local_lens.append(int(kw["input_ids"].shape[1])) if len(local_lens) < 1 else None,
        with_kwargs=True,
    )
    data = RandomTokens((steps + 1) * world, spec["seq_len"], spec["model"]["vocab"], spec.get("seed", 0))

    memory = StepMemory(cuda)
    hf_ctx: Any = None
    if impl == "hf_longctx":
        from hf_longctx.instrument import record_collectives

        hf_ctx = record_collectives()
    hf_stats = hf_ctx.__enter__() if hf_ctx is not None else None
    recorder = _make_callback(counter, memory, hf_stats, cuda, profile_step)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[recorder])
    mark("trainer_ready")  # model built, Trainer constructed (DeepSpeed is initialised inside train())
    t0 = time.perf_counter()
    try:
        trainer.train()
    finally:
        if hf_ctx is not None:
            hf_ctx.__exit__(None, None, None)
    train_s = time.perf_counter() - t0
    mark("train_end")

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn_key = trainer.model.config._attn_implementation if hasattr(trainer.model, "config") else None
    core = ALL_ATTENTION_FUNCTIONS.get(spec["attn"])
    return {
        "rank": rank,
        "steps": recorder.steps,
        "op_profile": recorder.op_profile,
        "process_peak_bytes": memory.process_peak,
        "memory_method": memory.method,
        "local_seq_len": local_lens[0] if local_lens else None,
        "train_s": train_s,
        "attn_impl": attn_key,
        # upstream overwrites the core kernel's registry entry with its wrapper
        "core_kernel": getattr(core, "__qualname__", repr(core)),
        "threads": torch.get_num_threads(),
        "timeline": dict(TIMELINE),
    }

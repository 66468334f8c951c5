"""What a benchmark run measures in each rank (benchmarks/README.md, "What is measured, and how"): `CommCounter`
(calls, bytes sent to other ranks and time of every collective, process-wide), `StepMemory` (the per-step peak:
`VmHWM` reset through `/proc/self/clear_refs` on CPU, the allocator peak on GPU), `recorder` (the `TrainerCallback`
writing one record per optimizer step, and one optional profiled step split by `categorize_ops`).
"""

from __future__ import annotations

import gc
import inspect
import os
import re
import resource
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# What one all_to_all_single / other collective sends to other ranks, given its bytes `n` and group size `ws`.
_VOLUME: dict[str, tuple[str, Callable[[int, int], float]]] = {
    "all_gather": ("tensor", lambda n, ws: n * (ws - 1)),
    "all_gather_into_tensor": ("input_tensor", lambda n, ws: n * (ws - 1)),
    "all_reduce": ("tensor", lambda n, ws: 2 * n * (ws - 1) / ws),
    "reduce_scatter_tensor": ("input", lambda n, ws: n * (ws - 1) / ws),
    "broadcast": ("tensor", lambda n, ws: n),
}
A2A = "all_to_all_single"
OP_CATEGORIES = ("attention", "matmul", "communication", "other")
# Kernel ops both implementations run on identical shapes (the model's own math).
_ATTENTION_OPS = ("scaleddotproduct", "flashattention", "flashattn", "efficientattention", "flexattention")
_MATMUL_OPS = frozenset(("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addmv", "aten::mv"))
_COMM_OPS = ("c10d::", "alltoall", "allgather", "allreduce", "reducescatter", "broadcast")


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


def _proc_status(field: str) -> int:
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
        self.process_peak = max(self.process_peak, _proc_status("VmHWM") * 1024)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        return _proc_status("VmRSS") * 1024

    def end(self) -> int:
        import torch

        if self.cuda:
            peak = torch.cuda.max_memory_allocated()
        elif self._sampler is not None:
            self._sampler.__exit__(None, None, None)
            peak, self._sampler = self._sampler.peak, None
        else:
            peak = _proc_status("VmHWM") * 1024
        self.process_peak = max(self.process_peak, peak)
        return peak


def op_category(name: str) -> str | None:
    """ "attention", "matmul" or "communication" for a profiler op or autograd node name, else None.

    Names are matched without case and underscores, so forward ops and their autograd nodes agree
    (`aten::_scaled_dot_product_flash_attention_for_cpu`, `ScaledDotProductFlashAttentionForCpuBackward0`,
    `_AllToAll`, `deepspeed::dim_zero_all_to_all`, `c10d::alltoall_base_`).
    """
    if name in _MATMUL_OPS:
        return "matmul"
    key = name.lower().replace("_", "")
    if any(op in key for op in _ATTENTION_OPS):
        return "attention"
    if any(op in key for op in _COMM_OPS):
        return "communication"
    return None


def categorize_ops(events: Iterable[tuple[float, Sequence[str]]]) -> dict[str, float]:
    """Split profiled self time into `OP_CATEGORIES`.

    Args:
        events: per profiler event its self time (s) and the names of the event and its ancestors,
            innermost first. An event counts for the innermost classified name of its chain, so the
            layout copies inside an all-to-all count as communication and a `mm` as matmul wherever it
            runs; time outside any classified op (elementwise, loss, optimizer, framework) is "other".

    Returns:
        Seconds per category plus "total" (the categories partition it: self times do not overlap).
    """
    out = dict.fromkeys(OP_CATEGORIES, 0.0)
    for self_s, chain in events:
        category = next((c for c in map(op_category, chain) if c is not None), "other")
        out[category] += self_s
    out["total"] = sum(out[c] for c in OP_CATEGORIES)
    return out


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


def probe_sample() -> dict[str, float]:
    """Resident MiB, OS threads and live process groups of this process, now (what a leak would raise)."""
    import torch.distributed as dist

    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * resource.getpagesize() / 2**20
    threads = _proc_status("Threads")
    groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    return {"rss_mib": rss, "threads": threads, "groups": groups}


_T0 = time.time()


def phase(message: str) -> None:
    """One timestamped progress line of a job (wall clock, seconds since the process started, rank), flushed at
    once: a job killed by its budget still says which phase it reached."""
    rank = os.environ.get("RANK", "0")
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.time() - _T0:7.1f} s rank {rank}] {message}", flush=True)


def object_census(records: Iterable[Any] = ()) -> dict[str, int]:
    """Live Python objects, tensors and the bytes of their distinct storages, after a full collection.

    Counts, unlike resident memory, do not move with the allocator or other processes: after `gc.collect()`
    the same program state gives the same numbers, so one more tensor per step is a leak on any machine.
    Objects reachable from `records` (the run's own per-step records and log: they grow by design) are
    left out of `objects`. Objects in the collector's permanent generation (`gc.freeze`) are neither
    collected nor counted: `recorder` freezes what the first step left alive (a collection and a walk over
    the ~450K objects of a Trainer process take 0.5 s; what a leak adds is created later).
    """
    import torch

    gc.collect()
    own: set[int] = set()
    stack = list(records)
    while stack:
        item = stack.pop()
        if gc.is_tracked(item) and id(item) not in own:
            own.add(id(item))
            stack.extend(gc.get_referents(item))
    objects = [o for o in gc.get_objects() if id(o) not in own]
    tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return {"objects": len(objects), "tensors": len(tensors), "tensor_bytes": sum(storages.values())}


def recorder(
    counter: CommCounter, memory: StepMemory, hf_stats: Any, cuda: bool, profile_step: int | None, census: bool = False
) -> Any:
    """The `TrainerCallback` that fills `.steps` (and `.op_profile` for the step numbered `profile_step`).

    `census` adds `object_census()` to every record, taken after the step's clock stopped (a collection and a
    walk over the objects created since the first step, whose survivors are frozen then).
    """
    import torch
    from transformers import TrainerCallback

    def hf_ops() -> dict[str, list[float]]:  # every op hf_longctx counts (all_to_all, ring_p2p, ...)
        ops = hf_stats.ops.items() if hf_stats is not None else ()
        return {op: [st.calls, st.bytes_sent, st.seconds] for op, st in ops}

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.op_profile: dict[str, float] | None = None
            self._seen, self._prof, self._last_end = 0, None, 0.0
            self._before: dict[str, Any] = {}

        def on_train_begin(self, args, state, control, **kwargs):
            phase("engine ready, training starts")
            self._last_end = time.perf_counter()

        def on_step_begin(self, args, state, control, **kwargs):
            self._seen += 1
            if self._seen - 1 == profile_step:
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._prof.__enter__()
                return
            mem = memory.begin()
            if cuda:
                counter.flush()
            self._before = {"comm": counter.snapshot(), "hf_ops": hf_ops(), "mem": mem, "cpu": time.process_time()}
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self.op_profile, self._prof = categorize_ops(_op_events(self._prof)), None
                self._last_end = time.perf_counter()
                return
            if cuda:
                torch.cuda.synchronize()
            t1, cpu = time.perf_counter(), time.process_time()
            peak = memory.end()
            if cuda:
                counter.flush()
            comm = _diff(counter.snapshot(), self._before["comm"])
            ours = _diff(hf_ops(), self._before["hf_ops"])
            a2a, hf_a2a = comm.pop(A2A, [0, 0.0, 0.0]), ours.get("all_to_all", [0, 0.0, 0.0])
            self.steps.append(
                {"step": state.global_step, "step_s": t1 - self._t0, "iter_s": t1 - self._last_end,
                 "cpu_s": cpu - self._before["cpu"], "mem_before": self._before["mem"], "mem_peak": peak,
                 "act_bytes": peak - self._before["mem"], "a2a_calls": a2a[0], "a2a_bytes": a2a[1], "a2a_s": a2a[2],
                 "hf_a2a_calls": hf_a2a[0], "hf_a2a_bytes": hf_a2a[1], "hf_a2a_s": hf_a2a[2], "other_comm": comm,
                 "hf_ops": ours, **probe_sample()}
            )  # fmt: skip
            if census:
                if len(self.steps) == 1:  # what the first step left alive: frozen, so later walks skip it
                    gc.collect()
                    gc.freeze()
                # The records list and the Trainer's log grow by design: not counted.
                self.steps[-1].update(object_census([self.steps, state.log_history]))
            self._last_end = t1
            phase(f"step {state.global_step}: {t1 - self._t0:.2f} s, peak {peak / 2**30:.2f} GiB")

    return StepRecorder()

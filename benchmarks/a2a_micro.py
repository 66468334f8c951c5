"""Micro-benchmark of `all_to_all_single` alone: one packed call vs the same bytes in several calls, and
reused vs freshly allocated buffers (what autograd hands the exchange in training).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.a2a_micro [--mib 6,12,24] [--iters 30]

Rank 0 prints the mean milliseconds per exchange of the given total size. Run it with
`MALLOC_MMAP_THRESHOLD_=65536` to see the allocation cost under `benchmarks.run`'s memory setting.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

SPLITS = (1, 3, 6)


def exchange_ms(total_elems: int, calls: int, fresh: bool, iters: int) -> float:
    """Mean wall time (ms) of sending `total_elems` float32 values as `calls` all-to-alls."""
    sends = [torch.randn(total_elems // calls) for _ in range(calls)]
    recvs = [torch.empty_like(s) for s in sends]
    for s, r in zip(sends, recvs, strict=True):  # warm-up: connections and first-touch of the reused buffers
        dist.all_to_all_single(r, s)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        for s, r in zip(sends, recvs, strict=True):
            if fresh:  # a new send copy and receive buffer per call, as autograd allocates them
                s, r = s.clone(), torch.empty_like(s)
            dist.all_to_all_single(r, s)
    dist.barrier()
    return (time.perf_counter() - t0) / iters * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", default="6,12,24", help="comma-separated total MiB per exchange")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for mib in (int(m) for m in args.mib.split(",")):
        elems = mib * 2**20 // 4 // 6 * 6  # divisible by every split and by up to 6 ranks
        row = {
            f"{'fresh' if fresh else 'reused'} {calls}x": exchange_ms(elems, calls, fresh, args.iters)
            for fresh in (False, True)
            for calls in SPLITS
        }
        if dist.get_rank() == 0:
            cells = ", ".join(f"{k} {v:.2f}" for k, v in row.items())
            print(f"ranks {dist.get_world_size()}, {mib} MiB: ms per exchange: {cells}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

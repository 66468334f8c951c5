"""Cost of the instrumentation: the same SP training step with `record_collectives` off and on.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.overhead [--seq-len 4096] [--steps 12]

Off and on alternate step by step in one process (same model, same batch), so machine drift cancels;
prints the median step time of each and their ratio, and appends them to benchmarks/results/<date>-overhead.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hf_longctx
from benchmarks._results import RESULTS
from benchmarks.worker import build_model
from hf_longctx.instrument import record_collectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    parser.add_argument(
        "--out", help="results prefix: appends to <out>.md (default benchmarks/results/<date>-overhead)"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    groups = hf_longctx.SequenceParallelGroups.build(dist.get_world_size())
    shape = {"arch": "llama", "vocab": 2048, "hidden": 128, "intermediate": 256, "layers": 2, "heads": 4,
             "kv_heads": 4, "head_dim": 32, "max_positions": args.seq_len}  # fmt: skip
    model = build_model(shape, "sdpa", "fp32", "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 2048, (1, args.seq_len), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"off": [], "on": []}

    def step() -> float:
        dist.barrier()
        start = time.perf_counter()
        shard = hf_longctx.shard_batch({"input_ids": ids, "labels": ids}, groups)
        shift_labels = shard.pop("shift_labels")
        loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)
        loss.backward()
        for p in model.parameters():  # the DP engine's gradient average, as DDP would do it
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    with hf_longctx.enable_sequence_parallel(model, groups):
        for _ in range(2):
            step()  # warm-up
        for i in range(2 * args.steps):
            mode = ("off", "on")[i % 2] if (i // 2) % 2 == 0 else ("on", "off")[i % 2]  # ABBA order
            with record_collectives() if mode == "on" else contextlib.nullcontext():
                times[mode].append(step())
    worst = {m: torch.tensor(t) for m, t in times.items()}
    for m in worst:  # the slowest rank decides a step
        dist.all_reduce(worst[m], op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        off, on = (statistics.median(worst[m].tolist()) for m in ("off", "on"))
        spread = statistics.quantiles(worst["off"].tolist(), n=4)
        line = (
            f"SP={groups.sp_world_size} S={args.seq_len}: median step {off:.4f} s with instrumentation off, "
            f"{on:.4f} s on (ratio on/off {on / off:.3f}); off-mode quartiles {spread[0]:.4f}-{spread[2]:.4f} s, "
            f"{args.steps} steps each, alternating ABBA"
        )
        print(line)
        path = Path(f"{args.out or RESULTS / f'{datetime.date.today().isoformat()}-overhead'}.md")
        path.parent.mkdir(parents=True, exist_ok=True)
        command = f"torchrun --standalone --nproc_per_node {dist.get_world_size()} -m benchmarks.overhead"
        with path.open("a") as f:
            f.write(f"- `{command} --seq-len {args.seq_len} --steps {args.steps}`: {line}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

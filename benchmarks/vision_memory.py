"""The vision tower sharded over the SP group: per-rank activation memory and vision time against frames (CPU).

    python -m benchmarks.vision_memory                              # 8 to 256 frames, 1 repeat (~5 min here)
    python -m benchmarks.vision_memory --frames 64 --out /tmp/vis   # a quick look

One video of F frames (8 x 8 patches of 2 x 2 pixels each: 64 patches, 16 merged tokens per frame) through a
random-init Qwen3-VL vision tower (4 blocks, hidden 64, 2 heads, DeepStack after block 1), one forward + backward
of the tower alone (a fixed random projection of its merged and DeepStack features as the loss), after one
warm-up. Variants: "unsharded", the tower on every frame in one process, which is what every SP rank runs
without the sharding (the same per rank at any SP size); "SP=4 unsharded", exactly that on 4 gloo ranks at
once (what an SP=4 job ran before the sharding, on the same cores as the sharded run); "SP=2 sharded" and
"SP=4 sharded", hf_longctx's sharded tower (`hf_longctx/multimodal/vision_shard.py`) on 2 and 4 gloo ranks,
gathered features included. Memory: the rank's resident high-water mark during the step minus its resident
memory at the step's start (the worst rank); time: the step's wall seconds and the process CPU seconds (slowest
rank). Ratios are to "unsharded"; "wall x SP=4 unsharded" compares wall time with the 4-rank run without the
sharding, which shares the machine's cores the same way (on a machine with fewer cores than ranks, the 1-process
wall time is no per-rank baseline). Target (issue 37): at 64+ frames, SP=4 sharded <= 0.35x unsharded in memory
and <= 0.4x in vision time. Writes
`benchmarks/results/<date>-vision-memory.{json,md}`.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import _harness, _results

MEMORY_TARGET, TIME_TARGET = 0.35, 0.4
FRAME = (8, 8)  # patches per frame (h, w)
VISION = {"depth": 4, "hidden_size": 64, "intermediate_size": 256, "num_heads": 2, "out_hidden_size": 256,
          "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 1, "in_channels": 3,
          "deepstack_visual_indexes": [1], "num_position_embeddings": 64}  # fmt: skip
VARIANTS = {"unsharded": (1, False), "SP=4 unsharded": (4, False), "SP=2 sharded": (2, True), "SP=4 sharded": (4, True)}


def step(rank: int, world: int, frames: int, shard: bool = True) -> dict[str, Any]:
    """Two forward + backward steps of the tower (the first a warm-up); the second's bytes and seconds."""
    import gc
    import time

    import torch
    import transformers

    import hf_longctx
    from benchmarks._measure import StepMemory
    from hf_longctx.multimodal.vision_shard import shard_vision_tower

    torch.set_num_threads(1)
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    tower = Qwen3VLVisionModel._from_config(transformers.Qwen3VLVisionConfig(**VISION)).train()
    groups = hf_longctx.SequenceParallelGroups.build(world) if world > 1 and shard else None
    undo = shard_vision_tower(tower, groups, lambda: True) if groups else []  # the tower called as in a forward
    gen = torch.Generator().manual_seed(0)
    h, w = FRAME
    pixels = torch.randn(frames * h * w, 12, generator=gen)
    grid = torch.tensor([[frames, h, w]])
    weights = torch.randn(frames * h * w // 4, VISION["out_hidden_size"], generator=gen)
    memory, act, wall, cpu = StepMemory(cuda=False), None, None, None
    for _ in range(2):
        tower.zero_grad(set_to_none=True)
        gc.collect()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # the ranks start together, sharded or not: they share the cores alike
        start = memory.begin()
        t0, c0 = time.perf_counter(), time.process_time()
        out = tower(pixels, grid_thw=grid)
        loss = sum((f * weights).sum() for f in (out.pooler_output, *out.deepstack_features))
        loss.backward()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        del out, loss
        act = memory.end() - start
    for remove in undo:
        remove()
    return {"rank": rank, "act_bytes": act, "vision_s": wall, "vision_cpu_s": cpu, "method": memory.method}


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "vision-memory", timeout=900, repeats=1)
    parser.add_argument("--frames", default="8,32,64,128,256")
    args = parser.parse_args(argv)
    cells = [int(f) for f in args.frames.split(",")]

    def launch(frames: int, variant: str) -> dict[str, Any]:
        sp, shard = VARIANTS[variant]
        return {"target": "benchmarks.vision_memory:step", "nproc": sp, "env": _harness.CPU_ENV, "frames": frames,
                "shard": shard, "init_backend": "gloo" if sp > 1 else None}  # fmt: skip

    def numbers(record: dict[str, Any]) -> dict[str, Any]:
        ranks = record["result"]["ranks"]
        return {"act": _harness.worst(record, "act_bytes"), "wall": max(r["vision_s"] for r in ranks),
                "cpu": max(r["vision_cpu_s"] for r in ranks)}  # fmt: skip

    session = _harness.Session("vision_memory", argv)
    session.alternate(cells, list(VARIANTS), args.repeats, args.timeout, launch)
    meta, rows = session.finish(), _harness.medians(session.records, numbers, base="unsharded")
    same_cores = {row["cell"]: row["wall"] for row in rows if row["variant"] == "SP=4 unsharded"}
    for row in rows:
        four = row["variant"].startswith("SP=4")
        row["x_wall_sp4"] = _harness.ratio(row["wall"], same_cores.get(row["cell"])) if four else None

    def reached(row: dict[str, Any], key: str, limit: float) -> str:
        return _results.target(row[key], limit) if row["variant"] == "SP=4 sharded" and row["cell"] >= 64 else ""

    columns: list[_results.Column] = [
        ("frames", lambda r: str(r["cell"])), ("run", lambda r: r["variant"]),
        _results.col("activation MiB per rank (worst)", "act", ".1f", _results.MiB),
        _results.col("x unsharded", "x_act", ".3f"),
        ("memory target", lambda r: reached(r, "x_act", MEMORY_TARGET)),
        _results.col("vision wall s", "wall", ".3f"), _results.col("x unsharded", "x_wall", ".3f"),
        _results.col("wall x SP=4 unsharded", "x_wall_sp4", ".3f"),
        _results.col("vision CPU s", "cpu", ".3f"), _results.col("x unsharded", "x_cpu", ".3f"),
        ("time target (CPU s)", lambda r: reached(r, "x_cpu", TIME_TARGET)),
    ]  # fmt: skip
    text = "Tower, frames and method: the module docstring of benchmarks/vision_memory.py."
    page = _results.page(f"Sharded vision tower: memory and time per rank ({meta['date']})", meta, text,
                         _results.table(columns, rows))  # fmt: skip
    _results.write(_harness.out(args), {"meta": meta, "rows": rows, "runs": session.records}, page)
    return 0 if rows and not meta["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())

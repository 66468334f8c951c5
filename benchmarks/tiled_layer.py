"""Per-rank peak memory and step time of a training step with and without `tiled_layer` (CPU, Ulysses SP=2).

    python -m benchmarks.tiled_layer [--seq 16384] [--hidden 256] [--heads 8] [--kv-heads 2] [--tile-tokens 1024]

Each rank runs a tiny Llama (fp32, sdpa, one document) on its shard under Ulysses SP with every memory flag that
exists besides `tiled_layer` ("all flags": gradient checkpointing, tiled_loss, tiled_mlp, offload_activations;
on CPU offloading is plain checkpointing), then the same plus `tiled_layer` (each tiled layer then runs under the
offload's checkpoint: one more tiled forward in backward), and `tiled_layer` without offload_activations (a tiled
layer is its own checkpoint). The length is chosen so that one layer's
`[tokens, hidden]` tensors dominate (the weights are small). Memory: a dispatch mode counts the bytes of every
tensor storage created in the step (forward and backward) until it is freed; the peak is the worst rank's.
The peak also splits into what the forward keeps for backward and the transients above it.
Time: the median of `--steps` timed steps (forward + backward, no dispatch mode), slowest rank. Results go to
`benchmarks/results/<date>-tiled-layer.{json,md}`.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import _harness as H
from benchmarks import _results as R
from benchmarks.head_chunks import live_bytes_mode

TARGET = "benchmarks.tiled_layer:measure"
ALL_FLAGS = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
CONFIGS = {
    "all flags": ALL_FLAGS,
    "all flags + tiled_layer": {**ALL_FLAGS, "tiled_layer": True},
    "tiled_layer, no offload": {"tiled_loss": True, "tiled_mlp": True, "tiled_layer": True},
}


def measure(
    rank: int,
    world: int,
    seq: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    layers: int,
    steps: int,
    flags: dict,
    tile_tokens: int,
) -> dict:
    """One measured step (peak bytes) and `steps` timed ones on this rank (see the module docstring)."""
    import torch
    import transformers

    import hf_longctx
    from hf_longctx.memory import apply_memory_flags, tiling

    torch.set_num_threads(1)
    tiling.MIN_TILE_TOKENS = tile_tokens  # automatic tiles (tiled_mlp and tiled_layer) of max(hidden, this)
    groups = hf_longctx.SequenceParallelGroups.build(world)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=seq, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model.activation_checkpointing_enable({"use_reentrant": False})
    hf_longctx.enable_sequence_parallel(model, groups)
    apply_memory_flags(model, argparse.Namespace(**flags))
    ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    shard = hf_longctx.shard_batch({"input_ids": ids, "labels": ids.clone()}, groups)
    shift = shard.pop("shift_labels")

    def step() -> None:
        model(**shard, labels=shift, shift_labels=shift).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: lazily built state, allocator
    mode = live_bytes_mode()
    with mode:
        loss = model(**shard, labels=shift, shift_labels=shift).loss
        kept = mode.live  # what the forward leaves for backward (saved tensors, the loss)
        loss.backward()
        del loss
        model.zero_grad(set_to_none=True)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    tokens = shard["input_ids"].shape[1]
    return {"peak": mode.peak, "kept": kept, "step_s": statistics.median(times), "tokens_per_rank": tokens}


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], shape: dict[str, Any]) -> str:
    base = rows[0]
    columns = [
        ("configuration", lambda r: r["name"]),
        ("peak MiB", lambda r: R.fmt(r["peak"], ".1f", R.MiB)),
        ("x", lambda r: R.fmt(H.ratio(r["peak"], base["peak"]), ".2f")),
        ("kept for backward MiB", lambda r: R.fmt(r["kept"], ".1f", R.MiB)),
        ("peak - kept MiB", lambda r: R.fmt(r["peak"] - r["kept"], ".1f", R.MiB)),
        ("x", lambda r: R.fmt(H.ratio(r["peak"] - r["kept"], base["peak"] - base["kept"]), ".2f")),
        ("step s", lambda r: R.fmt(r["step_s"], ".3f")),
        ("x", lambda r: R.fmt(H.ratio(r["step_s"], base["step_s"]), ".2f")),
    ]
    one_layer = 4 * shape["seq"] // 2 * shape["hidden"]  # one [tokens per rank, hidden] fp32 tensor
    lines = [
        "# tiled_layer: per-rank peak memory and step time (CPU, Ulysses SP=2)",
        "",
        R.run_line(meta),
        "",
        f"Llama, hidden {shape['hidden']}, {shape['heads']} / {shape['kv_heads']} heads, {shape['layers']} layers, "
        f"{R.seq(shape['seq'])} tokens (one document) over 2 ranks, sdpa, fp32; one `[tokens, hidden]` tensor per "
        f"rank is {R.fmt(one_layer, '.1f', R.MiB)} MiB. All flags = gradient checkpointing, tiled_loss, tiled_mlp "
        f"(automatic tiles), offload_activations; + tiled_layer (automatic tiles); both flags' tiles hold "
        f"max(hidden, {shape['tile_tokens']}) tokens. With offload_activations too, each tiled layer runs "
        "under the offload's checkpoint (on CPU offload is checkpointing: one more tiled forward in "
        "backward). Peak = bytes of the storages created in one forward + backward, worst rank; kept = what "
        "is alive when the forward returns (the layers' checkpointed inputs, the final norm's and "
        "tiled_loss's saved tensors: the same with or without tiled_layer); peak - kept = the backward's "
        "transients, what tiled_layer cuts; step = median step time, slowest rank.",
        "",
        *R.table(columns, rows),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tile-tokens", type=int, default=1024, help="MIN_TILE_TOKENS (tiles of max(hidden, this))")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("seq", "hidden", "heads", "kv_heads", "layers", "tile_tokens")}
    session = H.Session("tiled_layer", argv, Path("/tmp/hf_longctx_tiled_layer"))
    rows = []
    for name, flags in CONFIGS.items():
        record = session.run(
            {**shape, "name": name}, name, TARGET, 2, args.timeout,
            env=H.MALLOC_ENV, init_backend="gloo", **shape, steps=args.steps, flags=flags,
        )  # fmt: skip
        if record["status"] == "ok":
            ranks = record["result"]["ranks"]
            worst = max(ranks, key=lambda r: r["peak"])
            rows.append({"name": name, "peak": worst["peak"], "kept": worst["kept"]})
            rows[-1]["step_s"] = max(r["step_s"] for r in ranks)
            print(f"{name}: peak {rows[-1]['peak'] / R.MiB:.1f} MiB, step {rows[-1]['step_s']:.3f} s", flush=True)
    meta = session.finish(lambda r: r["spec"]["name"])
    if len(rows) == 2:
        print(f"tiled_layer / all flags: peak {rows[1]['peak'] / rows[0]['peak']:.2f}x, "
              f"step {rows[1]['step_s'] / rows[0]['step_s']:.2f}x")  # fmt: skip
    prefix = R.RESULTS / f"{datetime.date.today().isoformat()}-tiled-layer"
    R.write(prefix, {"meta": meta, "shape": shape, "rows": rows}, markdown(meta, rows, shape) if rows else "no runs\n")
    return 0 if len(rows) == 2 and not meta["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

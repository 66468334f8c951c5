"""Per-rank peak memory and step time of a training step with and without `tiled_layer` (CPU, Ulysses SP=2).

    python -m benchmarks.tiled_layer [--seqs 16384,32768] [--repeats 2] [--steps 2] [--tile-tokens 256]

Each rank runs a tiny Llama (fp32, sdpa, one document) on its shard under Ulysses SP with every memory flag that
exists besides `tiled_layer` ("all flags": gradient checkpointing, tiled_loss, tiled_mlp, offload_activations;
on CPU offloading moves nothing), then the same plus `tiled_layer` (or, `--variants`, plus head-chunked Ulysses,
issue 19's other new flag). Every tile of every flag holds
`--tile-tokens` tokens (the MLP's, the layer's, the loss's: `tiling.MIN_TILE_TOKENS`, `tiling.TILE_LOGITS`),
by default the hidden size, as the automatic rule `max(hidden, 4096)` gives a 4096-wide model (and DeepSpeed's
TiledMLP any model), so that one tile's `[tile, intermediate]` activations stay the size of a weight and, at
the lengths measured, one layer's `[tokens, hidden]` tensors dominate.
The two variants alternate (A B, B A, ...) in fresh processes; each number is the median over the repeats.

Memory, two ways, worst rank: a dispatch mode counts the bytes of every tensor storage created in one step
(forward and backward) until it is freed (its peak, and what the forward leaves for backward); and the growth of
the resident set over the step (`VmHWM`, reset through `/proc/self/clear_refs` at the step's start, glibc's mmap
threshold fixed: `plan_validate`'s method; the first timed step). Time: the median of `--steps` timed steps
(forward + backward, no dispatch mode), slowest rank. Results go to `benchmarks/results/<date>-tiled-layer.{json,md}`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from benchmarks import _harness as H
from benchmarks import _results as R
from benchmarks._measure import StepMemory
from benchmarks.head_chunks import live_bytes_mode

TARGET = "benchmarks.tiled_layer:measure"
VOCAB = 256
ALL_FLAGS = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}
VARIANTS = {
    "all flags": ALL_FLAGS,
    "all flags + tiled_layer": {**ALL_FLAGS, "tiled_layer": True},
    "all flags + ulysses_head_chunks=4": {**ALL_FLAGS, "ulysses_head_chunks": 4},  # issue 19's other new flag
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
    """One step counted by storage bytes, one by resident memory, `steps` timed ones (see the module docstring)."""
    import torch
    import transformers

    import hf_longctx
    from hf_longctx.memory import apply_memory_flags, tiling

    torch.set_num_threads(1)
    tiling.MIN_TILE_TOKENS, tiling.TILE_LOGITS = tile_tokens, tile_tokens * VOCAB
    groups = hf_longctx.SequenceParallelGroups.build(world)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=seq, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model.activation_checkpointing_enable({"use_reentrant": False})
    hf_longctx.enable_sequence_parallel(model, groups, ulysses_head_chunks=flags.pop("ulysses_head_chunks", 1))
    apply_memory_flags(model, argparse.Namespace(**flags))
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
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
    resident = StepMemory(cuda=False)
    start, times, rss = resident.begin(), [], 0
    for i in range(max(steps, 1)):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
        if i == 0:
            rss = resident.end() - start  # the first timed step's resident growth
    return {"peak": mode.peak, "kept": kept, "rss": rss, "step_s": statistics.median(times)}


def describe(shape: dict[str, Any]) -> str:
    """The page's text: the model, the flags and what each column counts."""
    one = R.fmt(16384 * shape["hidden"] * 2, ".0f", R.MiB)  # one [tokens per rank, hidden] fp32 tensor at 16K
    return (
        f"Llama, hidden {shape['hidden']}, {shape['heads']} / {shape['kv_heads']} heads, {shape['layers']} layers, "
        f"vocabulary {VOCAB}, one document of S tokens over 2 ranks, sdpa, fp32; one `[tokens, hidden]` fp32 tensor "
        f"per rank is {one} MiB at 16K. All flags = gradient checkpointing, tiled_loss, tiled_mlp, "
        "offload_activations (on CPU: no move); + tiled_layer (automatic tiles). Every tile holds "
        f"{shape['tile_tokens']} tokens (by default the hidden size: the automatic rule, max(hidden, 4096), gives "
        "Llama-3.1-8B tiles of its hidden size, and DeepSpeed's TiledMLP takes the same). Peak = bytes of the "
        "storages created in one forward + backward, worst rank; kept = what is alive when the forward returns; "
        "RSS = growth of the resident set over one step (plan_validate's VmHWM method); step = median step time, "
        "slowest rank; x = ratio to all flags at the same S; median over the repeats, the variants alternated. "
        "Issue 19: peak <= 0.5x where one layer's `[T, h]` tensors dominate, step <= 1.15x."
    )


def main(argv: list[str] | None = None) -> int:
    parser = H.options(__doc__, "tiled-layer", timeout=1800, repeats=2, steps=2)
    parser.add_argument("--seqs", default="16384,32768", help="comma-separated total sequence lengths")
    parser.add_argument(
        "--variants", default=",".join(list(VARIANTS)[:2]), help=f"comma-separated, of {list(VARIANTS)}"
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tile-tokens", type=int, help="tokens per tile of every tiled flag (default: --hidden)")
    args = parser.parse_args(argv)
    args.tile_tokens = args.tile_tokens or args.hidden
    shape = {k: getattr(args, k) for k in ("hidden", "heads", "kv_heads", "layers", "tile_tokens")}

    def launch(seq: int, variant: str) -> dict[str, Any]:
        return {"target": TARGET, "nproc": 2, "env": H.CPU_ENV, "init_backend": "gloo", **shape, "seq": seq,
                "steps": args.steps, "flags": VARIANTS[variant]}  # fmt: skip

    def numbers(record: dict[str, Any]) -> dict[str, Any]:
        worst = max(record["result"]["ranks"], key=lambda r: r["peak"])
        return {"peak": worst["peak"], "kept": worst["kept"], "rss": H.worst(record, "rss"),
                "step_s": H.worst(record, "step_s")}  # fmt: skip

    columns = [
        R.col("peak MiB", "peak", ".1f", R.MiB), R.col("x", "x_peak"), R.col("kept MiB", "kept", ".1f", R.MiB),
        R.col("RSS MiB", "rss", ".1f", R.MiB), R.col("x", "x_rss"), R.col("step s", "step_s", ".2f"),
        R.col("x", "x_step_s"),
    ]  # fmt: skip
    seqs, variants = [int(s) for s in args.seqs.split(",")], args.variants.split(",")
    if set(variants) - set(VARIANTS) or variants[0] != "all flags":
        parser.error(f"--variants: 'all flags' first, then any of {list(VARIANTS)[1:]}")
    return H.compare(
        args, argv, seqs, variants, launch, numbers, columns,
        "tiled_layer: per-rank peak memory and step time (CPU, Ulysses SP=2)", describe(shape),
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

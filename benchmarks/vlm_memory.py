"""Per-rank activation memory of a vision-language model (random-init Qwen2.5-VL) at SP=2 vs SP=1 (CPU).

    python -m benchmarks.vlm_memory                    # S = 8K and 16K, 2 repeats (a few minutes on 2 cores)
    python -m benchmarks.vlm_memory --seq-lens 4096 --repeats 1 --out /tmp/vlm   # a quick look

`step` is one run's ranks (two forward + backward steps, the second measured); the model, the batch and the
method: benchmarks/README.md ("Vision-language models"). Writes `benchmarks/results/<date>-vlm-memory.{json,md}`.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import _harness, _results

TARGET = 0.55  # issue 18: per-rank decoder activation memory at SP=2 <= 0.55 x SP=1
IMAGE, START, END = 1000, 1001, 1002
IMAGES = ((8, 8), (8, 12))  # grids (h, w) of 2 x 2-pixel patches: 16 and 24 image tokens after the 2 x 2 merge
TEXT = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "bos_token_id": 1,
        "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 65536, "eos_token_id": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}}  # fmt: skip
VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 256,
          "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 1, "in_channels": 3, "window_size": 8,
          "fullatt_block_indexes": [1]}  # fmt: skip


def _batch(seq_len: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, IMAGE, (1, seq_len), generator=gen)
    grids, at = [], seq_len // 3
    for h, w in IMAGES:
        n = h * w // 4
        ids[0, at - 1], ids[0, at : at + n], ids[0, at + n] = START, IMAGE, END
        grids.append((1, h, w))
        at += seq_len // 3
    pixels = torch.randn(sum(h * w for _, h, w in grids), 12, generator=gen)
    return {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE, -100), "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == IMAGE).long(), "pixel_values": pixels,
            "image_grid_thw": torch.tensor(grids)}  # fmt: skip


def step(rank: int, world: int, seq_len: int) -> dict[str, Any]:
    """Two forward + backward steps (the first a warm-up); the second's activation bytes on this rank."""
    import gc

    import torch
    import torch.nn.functional as F
    import transformers

    import hf_longctx
    from benchmarks._measure import StepMemory

    torch.set_num_threads(1)
    tokens = {
        "image_token_id": IMAGE,
        "video_token_id": 1003,
        "vision_start_token_id": START,
        "vision_end_token_id": END,
    }
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION, **tokens)
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa").train()
    batch = _batch(seq_len)
    groups = hf_longctx.SequenceParallelGroups.build(world) if world > 1 else None
    handle = hf_longctx.enable_sequence_parallel(model, groups) if groups is not None else None
    memory, act = StepMemory(cuda=False), None
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        gc.collect()
        start = memory.begin()
        if groups is None:
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            loss = F.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100)
        else:
            shard = hf_longctx.shard_batch(batch, groups)
            shift_labels = shard.pop("shift_labels")
            loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)
        loss.backward()
        del loss
        act = memory.end() - start
    if handle is not None:
        handle.remove()
    return {"rank": rank, "act_bytes": act, "method": memory.method}


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "vlm-memory", timeout=900, repeats=2)
    parser.add_argument("--seq-lens", default="8192,16384")
    args = parser.parse_args(argv)

    def launch(seq_len: int, variant: str) -> dict[str, Any]:
        sp = int(variant[-1])
        return {"target": "benchmarks.vlm_memory:step", "nproc": sp, "env": _harness.CPU_ENV, "seq_len": seq_len,
                "init_backend": "gloo" if sp > 1 else None}  # fmt: skip

    columns: list[_results.Column] = [
        _results.col("activation MiB per rank (worst)", "act", ".0f", _results.MiB),
        _results.col("x SP=1", "x_act", ".3f"),
        ("target", lambda r: _results.target(r["x_act"], TARGET) if r["variant"] == "SP=2" else ""),
    ]  # fmt: skip
    return _harness.compare(
        args, argv, [int(s) for s in args.seq_lens.split(",")], ("SP=1", "SP=2"), launch,
        lambda r: {"act": _harness.worst(r, "act_bytes")}, columns, "VLM activation memory per rank, SP=2 vs SP=1",
        "Model and method: benchmarks/README.md (\"Vision-language models\").", target=("SP=2", "x_act", TARGET),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

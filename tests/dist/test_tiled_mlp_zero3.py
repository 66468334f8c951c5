"""`tiled_mlp=True` under DeepSpeed ZeRO-3 (its parameters marked as partitioned): the ranks agree on the
tile count with one all-reduce per model forward, not one per MLP call, and the gradient-checkpoint
recompute in backward issues none; ranks with different sequence lengths still make the same calls."""

from __future__ import annotations

import torch

from tests._dist import run_distributed

STEPS, LAYERS = 2, 2


def _zero3_worker(rank: int, world_size: int) -> dict:
    from hf_longctx.instrument import record_collectives
    from hf_longctx.memory import tiled_mlp, tiling
    from hf_longctx.memory.tiled_mlp import enable_tiled_mlp
    from tests._models import tiny_model

    tiling.MIN_TILE_TOKENS = 8  # tiles of max(hidden=64, 8) tokens: 2 tiles on rank 0, 4 on rank 1
    model = tiny_model("llama", layers=LAYERS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    found, _ = tiled_mlp.find_tiled_mlps(model)
    for _, mlp in found:
        for p in mlp.parameters():
            p.ds_status = "NOT_AVAILABLE"  # what `_zero3` looks for; gathering itself is not exercised
    counts: list[int] = []
    inner = tiled_mlp.tiled_call

    def counting_call(forward, x, tiles, *args, **kwargs):
        counts.append(tiles)
        return inner(forward, x, tiles, *args, **kwargs)

    tiled_mlp.tiled_call = counting_call
    calls = []
    found[0][1].gate_proj.register_forward_hook(lambda *_: calls.append(1))
    handle = enable_tiled_mlp(model, True)
    ids = torch.randint(0, 128, (1, 128 * (rank + 1)), generator=torch.Generator().manual_seed(rank))
    with record_collectives() as stats:
        for _ in range(STEPS):
            model(input_ids=ids, labels=ids).loss.backward()
    reduces = stats.ops["all_reduce"].calls if "all_reduce" in stats.ops else 0
    handle.remove()
    return {"all_reduce": reduces, "tiles": counts, "gate_calls": len(calls)}


def test_tiles_agreed_once_per_forward_under_zero3():
    results = run_distributed(_zero3_worker, 2, timeout=180)
    for result in results:
        assert result["all_reduce"] == STEPS  # was LAYERS per forward plus LAYERS per recompute
    # The larger count (4 tiles) on both ranks, in every forward and every recompute of every layer.
    assert [r["tiles"] for r in results] == [[4] * (STEPS * LAYERS * 2)] * 2
    assert results[0]["gate_calls"] == results[1]["gate_calls"]

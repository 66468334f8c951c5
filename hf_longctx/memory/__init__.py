"""Memory flags: what grows with a rank's tokens besides attention, cut down one flag at a time.

`apply_memory_flags(model, config)` is the main entry (the Trainer integration calls it for every
model it prepares, with or without SP). Per rank holding `n` tokens of hidden size `h`, vocabulary
`V`, MLP width `I` and `L` decoder layers (the planner models exactly this):

- `tiled_loss`: no `[n, V]` logits in a training forward; the loss holds one tile of
  `lm_head.TILE_LOGITS` (2**24) float32 logits at a time (two for TRL's fused-head fields), and keeps
  `[n, h]` hidden-state gradients and a `[V, h]` float32 weight gradient from forward to backward.
- `tiled_mlp`: an MLP keeps only its input `[n, h]`; backward recomputes `[n / tiles, I]`
  intermediates one tile at a time (`tiles = ceil(n / max(h, 4096))` by default).
- `tiled_layer`: a Llama-family decoder layer keeps its input `[n, h]` and its K/V; forward and
  backward run every token-local part (norms, projections, attention per query tile, MLP) one
  `[n / tiles, ...]` tile at a time (`tiles = ceil(n / max(h, 4096))` by default).
- `offload_activations`: every layer is checkpointed and its saved input (`[n, h]` per layer) lives
  in host memory; the accelerator holds at most two layers' inputs (the one recomputed and the one
  prefetched) plus one layer's recompute.
"""

from hf_longctx._lazy import lazy_exports

_EXPORTS = {
    "MemoryHandle": "hf_longctx.memory.flags",
    "apply_memory_flags": "hf_longctx.memory.flags",
    "memory_flags_enabled": "hf_longctx.memory.flags",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

"""Tile sizes of the memory flags, torch-free so that the planner models exactly what runs.

`tile_tokens` sizes `tiled_loss`'s logit tiles (`lm_head.py`), `auto_tiles` counts `tiled_mlp`'s
sequence tiles (`tiled_mlp.py`, `tiled_layer.py`); `hf_longctx.planner` imports both without importing torch.
"""

from __future__ import annotations

import math

# Logits per tile: 2**24 (64 MiB in float32). The loss works on one such buffer in place (exp and
# gradient overwrite the logits; TRL's fields keep a second one for exp), so it adds ~64-128 MiB
# whatever the sequence length or vocabulary.
TILE_LOGITS = 2**24

# Fewest tokens per automatic MLP tile: smaller tiles make matmuls too thin to run at full speed.
MIN_TILE_TOKENS = 4096


def tile_tokens(vocab_size: int, tile_logits: int | None = None) -> int:
    """Tokens per tile so that one tile holds at most `tile_logits` logits (default: `TILE_LOGITS`, read
    at call time so that a test can shrink it), at least one token."""
    return max(1, (tile_logits or TILE_LOGITS) // vocab_size)


def auto_tiles(tokens: int, hidden_size: int) -> int:
    """Default tile count: tiles of `max(hidden_size, MIN_TILE_TOKENS)` tokens. With `hidden_size`
    tokens (DeepSpeed's `ceil(seqlen / hidden)` rule) a tile's `[tile, intermediate]` activations
    are no larger than the `[hidden, intermediate]` weight; small models keep 4096-token tiles."""
    return max(1, math.ceil(tokens / max(hidden_size, MIN_TILE_TOKENS)))

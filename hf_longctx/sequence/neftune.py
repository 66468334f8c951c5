"""NEFTune (arXiv 2310.05914) with the noise scale of the whole sequence under SP.

transformers' `neftune_post_forward_hook` adds uniform noise of magnitude `alpha / sqrt(seq_len * hidden)` to the
input embeddings, reading `seq_len` from the embedding output, which under SP is the shard's: the noise is
sqrt(P) too large (std 0.0112 against 0.0080 at SP=2, measured). This hook reads the row's length from the
forward's `ShardView`. Each rank draws its own noise for its own tokens: the noise differs from a run without SP,
as it does between any two runs; its distribution does not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hf_longctx.sequence.view import ShardView


def neftune_hook(view: Callable[[], ShardView | None]) -> Callable[..., Any]:
    """A forward hook for the input embeddings (reads `module.neftune_noise_alpha`, as transformers' does)."""

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        current = view()
        length = current.length if current is not None else output.size(1)
        magnitude = module.neftune_noise_alpha / torch.sqrt(torch.tensor(length * output.size(2)))
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)

    return hook

"""GRPO's and RLOO's generation under SP: on the plain model, with the sampling RNG of the run without SP.

The SP ranks of a group must sample the same completions for the same prompts (they then split those
sequences), and a DP x SP run must sample what the run without SP on its DP ranks samples. TRL seeds each
process by its index (`set_seed(seed, device_specific=True)`), so at the first generation every SP group
takes the RNG state of the process whose world rank is its DP rank (seeded as that DP rank would be without
SP), and before every later one the RNG state of its SP rank 0. Generation runs without SP attention; after
it the SP ranks compare a digest of prompts and completions and raise on a mismatch.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_longctx.attention.registry import _HANDLE_ATTR, enable_sequence_parallel
from hf_longctx.distributed.comm import all_gather_object
from hf_longctx.integrations.trainer.state import SequenceParallelState, _unwrap


@contextlib.contextmanager
def plain_model(state: SequenceParallelState, model: Any) -> Iterator[None]:
    """Run `model` without its SP attention inside the block (generation), then re-enable it."""
    model = _unwrap(model)
    index = next((i for i, h in enumerate(state.handles) if getattr(h, "model", None) is model), None)
    if index is None or getattr(model, _HANDLE_ATTR, None) is None:
        yield
        return
    state.handles[index].remove()
    try:
        yield
    finally:
        state.handles[index] = enable_sequence_parallel(model, state.groups, **state.config.attention_options())


def check_same_generation(state: SequenceParallelState, prompt_ids: Any, completion_ids: Any) -> None:
    """Raise unless every SP rank of the group generated the same completions for the same prompts."""
    digest = hashlib.sha256(repr((prompt_ids, completion_ids)).encode()).hexdigest()
    digests = all_gather_object(digest, state.groups.sp_group)
    if len(set(digests)) > 1:
        raise ValueError(
            f"The SP ranks of this group generated different completions (digests {digests}); they must "
            "sample identically: same seed on every rank, deterministic kernels, and no rank-dependent sampling."
        )


def _rng_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states.append(torch.cuda.get_rng_state())
    return states


def share_sampling_rng(state: SequenceParallelState, first: bool) -> None:
    """Set this rank's RNG state (CPU and the current CUDA device) to the one its SP group samples with.

    Args:
        state: the SP state (its groups).
        first: the trainer's first generation: take the state of world rank `dp_rank`, which TRL seeded as it
            seeds DP rank `dp_rank` without SP (a collective over every process); otherwise that of SP rank 0.
    """
    groups = state.groups
    if first:
        chosen = all_gather_object(_rng_states(), dist.group.WORLD)[groups.dp_rank]
    else:
        chosen = all_gather_object(_rng_states(), groups.sp_group)[0]
    torch.set_rng_state(chosen[0])
    if len(chosen) > 1:
        torch.cuda.set_rng_state(chosen[1])


def make_generate(trainer: Any, state: SequenceParallelState) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The `Patch` factory for `_generate_single_turn`: shared RNG, plain model, then the digest check.

    TRL 1.16's GRPO returns `(completion_ids, logprobs)` from it, RLOO `completion_ids` alone: the result is
    passed on as it is, and the completions are checked either way.
    """
    generations = 0

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def generate_single_turn(prompt_ids, *args, **kwargs):
            nonlocal generations
            share_sampling_rng(state, first=generations == 0)
            generations += 1
            with plain_model(state, trainer.model):
                result = original(prompt_ids, *args, **kwargs)
            completion_ids = result[0] if isinstance(result, tuple) else result
            check_same_generation(state, prompt_ids, completion_ids)
            return result

        return generate_single_turn

    return make

"""No tensor of O(S^2) anywhere in a forward + backward through hf_longctx, at sp_size 1 and 2.

The accelerator a Trainer would build (`parallelism_config=ParallelismConfig(...)`) prepares a tiny Llama on sdpa;
one step on a 32K-token row runs under `SquareTracker`, which fails on any tensor of S^2 / 8 elements or more.
Without SP, transformers' own sdpa path builds a `[S, S]` mask for a packed row (1G booleans here; on an H200 a
1.2M-token row asked for 1,341 GiB): hf_longctx serves attention at sp_size=1 too, per document, with no mask.
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

S = 32768
FLAGS = {"none": {}, "all": {"tiled_loss": True, "tiled_layer": True, "offload_activations": True}}


def _batch(packed: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 256, (1, S), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in (4096, 17, 12271, 16384)]) if packed else torch.arange(S)
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": pos.unsqueeze(0)}


def track_steps(rank: int, world_size: int) -> dict[str, tuple[int, str] | str]:
    """Every (data, flags) case at sp_size=world_size: the largest tensor of its forward + backward; and the
    attention key the model ran with."""
    from accelerate import Accelerator

    import hf_longctx
    from hf_longctx.integrations.trainer import detach
    from hf_longctx.integrations.trainer.state import sp_state
    from tests._models import tiny_model
    from tests._square_tracker import SquareTracker

    largest = {}
    for flags_name, flags in FLAGS.items():
        accelerator = Accelerator(
            cpu=True, parallelism_config=hf_longctx.ParallelismConfig(sp_size=world_size, **flags)
        )
        model = tiny_model("llama", hidden=64, layers=2, num_heads=2, num_kv_heads=1, vocab=256)
        model.config.max_position_embeddings = S
        model = accelerator.prepare_model(model)
        for data in ("packed", "single"):
            batch = _batch(data == "packed")
            state = sp_state(accelerator)
            if state is not None:  # SP: this rank's shard, labels already shifted
                batch = hf_longctx.shard_batch(batch, state.groups)
                batch["labels"] = batch["shift_labels"]
            tracker = SquareTracker(S * S // 8)
            with tracker:
                model(**batch).loss.backward()
            largest[f"{data}/{flags_name}"] = (tracker.largest, tracker.where)
            model.zero_grad(set_to_none=True)
        largest[f"attention/{flags_name}"] = accelerator.unwrap_model(model).config._attn_implementation
        detach(accelerator)
    return largest


@pytest.mark.parametrize("sp_size", [1, 2])
def test_no_tensor_of_s_squared_over_8_elements_at_32k_tokens(sp_size):
    results = run_distributed(track_steps, sp_size, timeout=420)
    for rank, largest in enumerate(results):
        for flags in FLAGS:
            assert largest.pop(f"attention/{flags}").startswith("hf_longctx_ulysses_"), (rank, flags)
        assert set(largest) == {f"{d}/{f}" for d in ("packed", "single") for f in FLAGS}, largest
        for case, (n, where) in largest.items():
            assert 0 < n < S * S // 8, (rank, case, n, where)

"""Per-document views of a packed batch (`hf_longctx.sequence.documents`) and the per-document run-time RoPE
(`sequence.rope`), rank by rank in one process: every rank's cos / sin and the rotary module's state equal each
document run alone, one after another in row order."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from hf_longctx.data.layout import pad_multiple
from hf_longctx.sequence.documents import document_runs, index_in_document
from hf_longctx.sequence.rope import RuntimeRope
from hf_longctx.sequence.view import ShardView


def _positions(rows: list[list[int]], pad: int = 0) -> torch.Tensor:
    """Packed rows, SP padding continuing each row's last document by `pad` positions."""
    out = []
    for row in rows:
        pos = torch.cat([torch.arange(n) for n in row])
        out.append(torch.cat([pos, pos[-1] + 1 + torch.arange(pad)]))
    return torch.stack(out)


def test_index_in_document_restarts_per_document_and_ignores_the_first_position():
    assert index_in_document(_positions([[3, 2, 4]])).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # One document whose positions do not start at 0: its index is still arange, as run alone.
    assert index_in_document(torch.arange(5, 10)[None]).tolist() == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize(("layout", "world"), [("contiguous", 1), ("contiguous", 4), ("zigzag", 2)])
def test_document_runs_cover_every_token_once_in_document_order(layout, world):
    rows, length = [[5, 5, 3, 6], [4, 4, 11]], 19
    sl = length + (-length % pad_multiple(layout, world))
    positions = _positions(rows, sl - length)
    for rank in range(world):
        view = ShardView.build(positions, layout, rank, world, length)
        runs = document_runs(view)
        # Runs: (5, 5) merged, 3, 6, then the next row's (4, 4), 11: the largest real position of each.
        assert runs.largest == [4, 2, 5, 3, 10] and runs.packed
        flat = torch.cat(runs.tokens).sort().values
        assert torch.equal(flat, torch.arange(2 * view.local_index.numel()))
        assert torch.equal(runs.real, (view.local_index < length).repeat(2))
        held = positions[:, view.local_index].flatten()
        for largest, tokens in zip(runs.largest, runs.tokens, strict=True):
            real = runs.real[tokens]
            assert bool((held[tokens][real] <= largest).all())
            assert torch.equal(tokens, tokens.sort().values)  # sequence order within a run


def test_one_token_documents_join_the_run_before():
    # Padding whose positions restart at 0 (TRL's collator): one-token documents, no run of their own.
    positions = torch.tensor([[0, 0, 1, 2, 0, 0], [0, 1, 2, 3, 0, 0]])
    runs = document_runs(ShardView.build(positions, "contiguous", 0, 1, None))
    assert runs.largest == [2, 3] and not runs.packed  # one document of several tokens per row: unpacked rows
    assert [t.tolist() for t in runs.tokens] == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    runs = document_runs(ShardView.build(torch.tensor([[0, 1, 0, 0, 1, 2, 0]]), "contiguous", 0, 1, None))
    assert runs.largest == [1, 2] and runs.packed
    assert [t.tolist() for t in runs.tokens] == [[0, 1, 2], [3, 4, 5, 6]]


def _rotary(kind: str):
    from transformers import LlamaConfig, Phi3Config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    common = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16}
    if kind == "dynamic":
        rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
        return LlamaRotaryEmbedding(LlamaConfig(**common, max_position_embeddings=32, rope_parameters=rope))
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.5] * 8,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # fmt: skip
    config = Phi3Config(**common, max_position_embeddings=64, original_max_position_embeddings=16, rope_parameters=rope)
    return Phi3RotaryEmbedding(config)


@pytest.mark.parametrize(("kind", "layout", "world"), [("dynamic", "contiguous", 1), ("dynamic", "zigzag", 2),
                                                       ("longrope", "contiguous", 4)])  # fmt: skip
def test_runtime_rope_gives_each_document_its_own_frequencies(kind, layout, world):
    # Dynamic NTK with 32 native positions: grows (40), keeps (36 < 40), resets (20), grows again (35); then a
    # second batch starting from that state.
    batches = [[[40, 36, 20, 35]], [[30, 17], [12, 35]]]
    fresh = _rotary(kind)
    alone, reference = copy.deepcopy(fresh), []
    for rows in batches:
        row_out = []
        for row in rows:
            row_out.append(torch.cat([alone(torch.zeros(1), torch.arange(n)[None])[0][0] for n in row]))
        reference.append(torch.stack(row_out))
    for rank in range(world):
        module, current = copy.deepcopy(fresh), {}
        patched = RuntimeRope(torch.nn.ModuleList([module]), functools.partial(current.get, "view"))
        assert len(patched.patches) == 1
        for rows, expected in zip(batches, reference, strict=True):
            length = sum(rows[0])
            positions = _positions(rows, -length % pad_multiple(layout, world))
            current["view"] = view = ShardView.build(positions, layout, rank, world, length)
            cos, _ = module(torch.zeros(1), positions[:, view.local_index])
            real = view.local_index < length
            assert torch.allclose(cos[:, real], expected[:, view.local_index[real]], rtol=1e-6, atol=1e-6)
            again, _ = module(torch.zeros(1), positions[:, view.local_index])
            assert again is cos  # a second call in the same forward: the same result, the state not moved on
            patched.end_forward()
        assert module.inv_freq.tolist() == alone.inv_freq.tolist()
        assert getattr(module, "max_seq_len_cached", None) == getattr(alone, "max_seq_len_cached", None)
        patched.remove()
        assert "forward" not in vars(module)


def test_the_longrope_fixtures_switch_to_their_long_factors():
    """Past 16 positions the test models' longrope runs its long factors (the Phi-3 fixture once read 4096 native
    positions from `Phi3Config`'s own field and never switched, so every longrope case compared two identical
    computations)."""
    from tests._sequence_models import sequence_model

    for rotary in (_rotary("longrope"), sequence_model("longrope").model.rotary_emb):
        short = rotary.inv_freq.clone()
        cos, _ = rotary(torch.zeros(1), torch.arange(40)[None])
        assert not torch.equal(rotary.inv_freq, short)
        long, _ = rotary(torch.zeros(1), torch.arange(40)[None])
        assert torch.equal(cos, long)  # the long factors stay for a row past the native length

"""Exactness of the ring, hybrid and auto backends at the model level: SP=2 and SP=4 vs the unsharded run.

Loss relative difference <= 1e-6 and every parameter's gradient within 1e-5 of its largest value, for
Llama / Qwen3 / Mistral shapes (MHA, GQA, MQA, an irregular 12 x 3 split, 9 x 3 and 6 x 2 heads) with
packed rows, padding, an odd length and shards without labels; both ring variants, zigzag and
contiguous layouts, hybrid 2 x 2, and auto (which must pick what `AUTO_EXPECTED` says). One spawn
per world size (shared with test_ring_ops.py, `_ring_spawn.py`); references computed once here
(`_parity.reference_loss_and_grads`).
"""

from __future__ import annotations

import pytest

from tests.dist import _parity as P
from tests.dist import _ring_parity as RP
from tests.dist import _ring_spawn

_refs: dict[tuple, tuple] = {}


def _reference(spec_id: str, attn: str, case_name: str):
    key = (spec_id, attn, case_name)
    if key not in _refs:
        loss, grads, _ = P.reference_loss_and_grads(RP.SPECS[spec_id].build(attn), P.make_case(case_name))
        _refs[key] = (loss, grads)
    return _refs[key]


PARAMS = [(w, c) for w, combos in RP.COMBOS.items() for c in combos]


@pytest.mark.parametrize(("world", "combo"), PARAMS, ids=[f"sp{w}-{RP.combo_id(c)}" for w, c in PARAMS])
def test_ring_backends_match_unsharded_loss_and_grads(world, combo):
    per_rank = [r["parity"][combo] for r in _ring_spawn.results(world)]
    result = per_rank[0]
    opts, spec_id, attn, case_name = combo
    assert all(r["loss"] == result["loss"] for r in per_rank)
    ref_loss, ref_grads = _reference(spec_id, attn, case_name)
    assert P.loss_error(result["loss"], ref_loss) <= P.LOSS_RTOL, (result["loss"], ref_loss)
    errors = P.grad_errors(result["grads"], ref_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= P.GRAD_RTOL, (worst, errors[worst])
    # What ran: the requested backend (auto: the expected choice) and the layout the data side used.
    backend = dict(opts)["backend"]
    expected = RP.AUTO_EXPECTED[(world, spec_id)] if backend == "auto" else None
    name, degree = result["backend"]
    if expected:
        assert (name, degree) == expected
    else:
        assert name == backend and degree == (dict(opts)["ulysses_degree"] or 1)
    assert result["layout"] == ("contiguous" if name == "ulysses" else dict(opts)["ring_layout"])
    assert result["layout_after"] == "contiguous"
    if case_name == "one_label":
        assert result["masked_ranks"] == world - 1  # one shard holds the only label, in every layout


def _features() -> list[dict]:
    per_rank = [r["features"] for r in _ring_spawn.results(2)]
    for rank, result in enumerate(per_rank):
        for name, value in result.items():
            assert "error" not in value, f"rank {rank} {name}:\n{value['error']}"
    return per_rank


def test_token_layout_mismatches_raise_naming_the_fix():
    for result in _features():
        mismatch = result["mismatch"]
        assert mismatch["shard_layout"] == "zigzag"
        assert "'zigzag' token layout" in mismatch["second_layout"]
        assert "shard_batch" in mismatch["zigzag_into_ulysses"]


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
def test_ring_refuses_softcap_and_sinks_naming_ulysses(feature):
    for result in _features():
        message = result["refusals"][feature]
        assert message is not None and 'sp_backend="ulysses"' in message

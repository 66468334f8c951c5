"""DPOTrainer's SP setup without processes: the targets built on the full sequence, and every refused option."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.integrations.trl import dpo
from hf_longctx.integrations.trl.errors import UnsupportedSetup


def _collate(features):
    return {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [5, 6, 10, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
        "completion_mask": torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]),
    }


def test_targets_are_the_next_completion_token_on_the_full_sequence():
    batch = dpo._with_targets(_collate)([])
    assert batch[dpo.TARGETS_KEY].tolist() == [[-100, 7, 8, 9, -100], [-100, 10, -100, -100, -100]]
    # Sharded over 2 ranks (padded to 6): rank 0's last position scores rank 1's first token.
    shards = [shard_batch_for_rank(batch, r, 2) for r in range(2)]
    assert shards[0][dpo.TARGETS_KEY][0].tolist() == [-100, 7, 8]
    assert shards[1][dpo.TARGETS_KEY][0].tolist() == [9, -100, 0]  # the SP padding: masked by attention 0
    assert shards[1]["attention_mask"][0].tolist() == [1, 1, 0]
    assert "labels" not in shards[0]  # no Trainer num_items_in_batch: the run without SP counts none either


def test_a_collator_without_completion_mask_is_named():
    with pytest.raises(ValueError, match="completion_mask"):
        dpo._with_targets(lambda f: {"input_ids": torch.zeros(2, 3, dtype=torch.long)})([])


def _trainer(**overrides):
    text = SimpleNamespace()
    fields = {
        "loss_types": ["sigmoid"],
        "f_divergence_type": "reverse_kl",
        "ld_alpha": None,
        "use_weighting": False,
        "_is_vision_dataset": False,
        "_is_vlm": False,
        "compute_metrics": None,
        "args": SimpleNamespace(router_aux_loss_coef=None),
        "model": SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text)),
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_supported_settings_pass():
    from hf_longctx.integrations.trl.dpo_losses import F_DIVERGENCES, LOSS_TYPES

    for kind in F_DIVERGENCES:
        dpo.check_dpo_settings(_trainer(loss_types=list(LOSS_TYPES), f_divergence_type=kind, use_weighting=True))


def test_every_trl_loss_type_has_a_formula():
    from trl import DPOConfig

    from hf_longctx.integrations.trl.dpo_losses import LOSS_TYPES

    # TRL's own list (its DPOConfig help); a loss type TRL adds later is refused until it has one here.
    quoted = DPOConfig.__dataclass_fields__["loss_type"].metadata["help"].split("`")[1::2]
    listed = {name.strip("'") for name in quoted if name.startswith("'")}
    assert listed == set(LOSS_TYPES)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"loss_types": ["sigmoid", "future_loss"]}, "loss_type='future_loss'"),
        ({"f_divergence_type": "chi2"}, "f_divergence_type='chi2'"),
        ({"ld_alpha": 0.5}, "ld_alpha"),
        ({"_is_vlm": True}, "vision"),
        ({"compute_metrics": lambda prediction: {}}, "compute_metrics"),
    ],
)
def test_refused_settings_are_named(overrides, named):
    with pytest.raises(UnsupportedSetup, match=named):
        dpo.check_dpo_settings(_trainer(**overrides))


def test_moe_router_aux_loss_is_served():
    """The router loss is computed exactly under SP now (tests/dist/test_dpo.py compares it with TRL's own run)."""
    moe = SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.01)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: moe))
    dpo.check_dpo_settings(_trainer(model=model))

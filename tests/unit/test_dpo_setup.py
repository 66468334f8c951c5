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
        "args": SimpleNamespace(router_aux_loss_coef=None),
        "model": SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text)),
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def test_supported_settings_pass():
    dpo.check_dpo_settings(_trainer(loss_types=list(dpo.SUPPORTED_LOSSES)))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"loss_types": ["sigmoid", "aot"]}, "loss_type='aot'"),
        ({"loss_types": ["nca_pair"]}, "loss_type='nca_pair'"),
        ({"f_divergence_type": "js_divergence"}, "f_divergence_type"),
        ({"ld_alpha": 0.5}, "ld_alpha"),
        ({"use_weighting": True}, "use_weighting"),
        ({"_is_vlm": True}, "vision"),
    ],
)
def test_refused_settings_are_named(overrides, named):
    with pytest.raises(UnsupportedSetup, match=named):
        dpo.check_dpo_settings(_trainer(**overrides))


def test_moe_router_aux_loss_is_refused():
    moe = SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.01)
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: moe))
    with pytest.raises(UnsupportedSetup, match="router aux loss.*router_aux_loss_coef=0.0"):
        dpo.check_dpo_settings(_trainer(model=model))
    dpo.check_dpo_settings(_trainer(model=model, args=SimpleNamespace(router_aux_loss_coef=0.0)))

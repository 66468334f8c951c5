"""RewardTrainer's SP path scores the last real token: a model that pools otherwise is refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_longctx.integrations.trl.errors import UnsupportedSetup
from hf_longctx.integrations.trl.reward import setup_reward


class _Scorer(torch.nn.Module):
    base_model_prefix = "model"

    def __init__(self, pooling: str | None) -> None:
        super().__init__()
        self.score = torch.nn.Linear(4, 1)
        self.pooling = pooling  # Cohere-Compass: "bos" | "eos" | "mean" (None: "eos")
        self.config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(pad_token_id=0))


@pytest.mark.parametrize("pooling", ["bos", "mean"])
def test_first_token_and_mean_pooling_are_refused(pooling):
    trainer = SimpleNamespace(model=_Scorer(pooling))
    with pytest.raises(UnsupportedSetup, match=f"pooling='{pooling}'"):
        setup_reward(trainer, SimpleNamespace(groups=None, undo=[]))


def test_last_token_pooling_is_served():
    trainer = SimpleNamespace(model=_Scorer("eos"), compute_loss=lambda *a, **k: None)
    state = SimpleNamespace(groups=None, undo=[], replicated_outputs=False)
    setup_reward(trainer, state)
    assert state.replicated_outputs and len(state.undo) == 2
    for undo in reversed(state.undo):
        undo()

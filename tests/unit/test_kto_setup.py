"""KTOTrainer's SP setup without processes: both batches' targets on the full sequences, the KL batch sharded as a
batch of its own, every loss type (value and gradient) against TRL's own `_compute_loss`, and every refused option."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from hf_longctx.data.consistency import SIGNATURE_KEY
from hf_longctx.data.sharding import shard_batch_for_rank
from hf_longctx.distributed.layout_slot import LayoutSlot
from hf_longctx.integrations.trl import kto
from hf_longctx.integrations.trl.errors import UnsupportedSetup
from hf_longctx.integrations.trl.kto_losses import LOSS_TYPES, unpaired_losses
from hf_longctx.integrations.trl.row_logps import TARGETS_KEY


def _collate(features):
    """A TRL-shaped unpaired batch: a 5-token row (completion 3 tokens) and a 2-token row; KL rows of length 6."""
    return {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [5, 10, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]),
        "completion_mask": torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]),
        "KL_input_ids": torch.tensor([[5, 6, 10, 0, 0, 0], [5, 7, 8, 9, 11, 12]]),
        "KL_attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]),
        "KL_completion_mask": torch.tensor([[0, 0, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1]]),
        "label": torch.tensor([True, False]),
    }


def _collator(rank: int, world: int = 2, calculate_kl: bool = True):
    groups = SimpleNamespace(sp_rank=rank, sp_world_size=world, layout_slot=LayoutSlot())
    return kto._make_collator(SimpleNamespace(calculate_KL=calculate_kl), SimpleNamespace(groups=groups))(_collate)


def test_targets_are_the_next_completion_token_and_the_kl_batch_is_sharded_on_its_own():
    shards = [_collator(rank)([]) for rank in range(2)]
    batch = shards[0]
    assert batch[TARGETS_KEY].tolist() == [[-100, 7, 8, 9, -100], [10, -100, -100, -100, -100]]
    assert not any(key.startswith("KL_") for key in batch)  # moved into one entry the Trainer's sharding leaves
    assert batch["input_ids"].shape == (2, 5)  # the Trainer's loader shards the main batch afterwards
    # The KL batch (6 tokens, not the main batch's 5) is padded and sliced by its own length: 3 tokens per rank.
    kl = [shard[kto.KL_KEY] for shard in shards]
    assert [k["input_ids"].tolist() for k in kl] == [[[5, 6, 10], [5, 7, 8]], [[0, 0, 0], [9, 11, 12]]]
    # Rank 0's last position scores rank 1's first KL token: the targets were built before sharding.
    assert kl[0][TARGETS_KEY].tolist() == [[-100, 10, -100], [7, 8, 9]]
    assert kl[1][TARGETS_KEY].tolist() == [[-100, -100, -100], [11, 12, -100]]
    assert [k["position_ids"].tolist()[0] for k in kl] == [[0, 1, 2], [3, 4, 5]]
    assert int(kl[0][SIGNATURE_KEY][2]) == 6  # its own row length, which the forward's checks and views read
    full = {"input_ids": _collate([])["KL_input_ids"], "attention_mask": _collate([])["KL_attention_mask"]}
    for rank, shard in enumerate(kl):
        assert torch.equal(shard["attention_mask"], shard_batch_for_rank(full, rank, 2)["attention_mask"])
    assert "labels" not in kl[0] and "labels" not in batch  # no Trainer num_items_in_batch


def test_the_kl_batch_follows_the_layout_the_backend_claims():
    groups = SimpleNamespace(sp_rank=0, sp_world_size=2, layout_slot=LayoutSlot())
    collate = kto._make_collator(SimpleNamespace(calculate_KL=True), SimpleNamespace(groups=groups))(_collate)
    groups.layout_slot.claim("zigzag")  # after the collator was built, as when the model is prepared later
    kl = collate([])[kto.KL_KEY]
    assert kl["position_ids"].tolist()[0] == [0, 1, 6, 7]  # zigzag over 2 x 2 chunks of the padded 8 tokens


def test_apo_batches_carry_no_kl_batch():
    def collate(features):
        return {k: v for k, v in _collate(features).items() if not k.startswith("KL_")}

    groups = SimpleNamespace(sp_rank=0, sp_world_size=2, layout_slot=LayoutSlot())
    batch = kto._make_collator(SimpleNamespace(calculate_KL=False), SimpleNamespace(groups=groups))(collate)([])
    assert kto.KL_KEY not in batch and TARGETS_KEY in batch


def test_a_collator_without_the_needed_keys_is_named():
    def collate(features):
        return {k: v for k, v in _collate(features).items() if k not in ("label", "KL_completion_mask")}

    groups = SimpleNamespace(sp_rank=0, sp_world_size=2, layout_slot=LayoutSlot())
    with pytest.raises(ValueError, match="label, KL_completion_mask"):
        kto._make_collator(SimpleNamespace(calculate_KL=True), SimpleNamespace(groups=groups))(collate)([])


class _TokenLogps(torch.nn.Module):
    """A stand-in policy whose per-token log-prob of token t at position p is `table[t, p]` (a parameter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Parameter(-torch.rand(16, 8) * 3)
        self.is_gradient_checkpointing = False

    def forward(self, input_ids, attention_mask, labels, fused_lm_head, **kwargs):
        scored = labels[:, 1:] != -100
        positions = torch.arange(input_ids.shape[1] - 1).expand_as(scored)
        log_probs = self.table[input_ids[:, 1:], positions] * scored
        return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros_like(log_probs), mean_logits=log_probs)


def _trl_loss(loss_type: str, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """TRL 1.16's own `KTOTrainer._compute_loss` on `batch` (precomputed reference log-probs, one process)."""
    from trl import KTOTrainer

    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x.reshape(-1))
    trainer = SimpleNamespace(
        model=model, accelerator=accelerator, calculate_KL=loss_type == "kto", aux_loss_enabled=False,
        precompute_ref_logps=True, beta=0.5, loss_type=loss_type, desirable_weight=1.3, undesirable_weight=0.7,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _tp_size=1, _total_train_tokens=0,
    )  # fmt: skip
    trainer._compute_kl_logps = KTOTrainer._compute_kl_logps.__get__(trainer)
    return KTOTrainer._compute_loss(trainer, model, batch, return_outputs=False)


def _row_logps(model: _TokenLogps, ids: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """Each row's summed completion log-prob from the targets hf_longctx builds (no SP: the whole sequence)."""
    targets = kto.completion_targets(ids, completion)
    scored = targets[:, :-1] != -100
    positions = torch.arange(ids.shape[1] - 1).expand_as(scored)
    return (model.table[ids[:, 1:], positions] * scored).sum(dim=1)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_and_its_gradient_match_trl(loss_type):
    batch = {
        **_collate([]),
        "label": torch.tensor([True, False, True, False]),
        "ref_logps": torch.tensor([-9.0, -4.0, -2.5, -7.0]),
        "ref_KL_logps": torch.tensor([-9.0, -6.0, -8.0, -7.0]),
    }
    for key in ("input_ids", "attention_mask", "completion_mask"):  # 4 rows: two of each side
        batch[key] = batch[key].repeat(2, 1)
        batch[f"KL_{key}"] = batch[f"KL_{key}"].repeat(2, 1)
    trl_model, model = _TokenLogps(), _TokenLogps()
    want = _trl_loss(loss_type, trl_model, batch)
    want.backward()

    logps = _row_logps(model, batch["input_ids"], batch["completion_mask"])
    kl = torch.zeros(())
    if loss_type == "kto":
        with torch.no_grad():
            kl_logps = _row_logps(model, batch["KL_input_ids"], batch["KL_completion_mask"])
        kl = (kl_logps - batch["ref_KL_logps"]).mean().clamp(min=0)
        assert kl > 0  # the KL term is on
    labels = batch["label"]
    ratios = logps - batch["ref_logps"]
    got = unpaired_losses(ratios[labels], ratios[~labels], kl, 0.5, loss_type, (1.3, 0.7)).nanmean()
    got.backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    assert torch.allclose(model.table.grad, trl_model.table.grad, rtol=1e-6, atol=1e-9)
    assert trl_model.table.grad.abs().sum() > 0


def test_every_trl_loss_type_has_a_formula():
    from trl import KTOConfig

    # TRL's own list; a loss type TRL adds later is refused until it has one here.
    assert set(KTOConfig.__dataclass_fields__["loss_type"].metadata["choices"]) == set(LOSS_TYPES)
    with pytest.raises(ValueError, match="future"):
        unpaired_losses(torch.zeros(1), torch.zeros(1), torch.zeros(()), 0.1, "future")


def _trainer(**overrides):
    fields = {"loss_type": "kto", "_is_vision_dataset": False, "_is_vlm": False, "compute_metrics": None}
    return SimpleNamespace(**{**fields, **overrides})


def test_supported_settings_pass():
    for loss_type in LOSS_TYPES:
        kto.check_kto_settings(_trainer(loss_type=loss_type))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"loss_type": "future_loss"}, "loss_type='future_loss'"),
        ({"_is_vision_dataset": True}, "vision"),
        ({"_is_vlm": True}, "vision"),
        ({"compute_metrics": lambda p: {}}, "compute_metrics"),
    ],
)
def test_refused_settings_are_named(overrides, named):
    with pytest.raises(UnsupportedSetup, match=named):
        kto.check_kto_settings(_trainer(**overrides))

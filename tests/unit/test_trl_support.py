"""The TRL trainer registry: every trainer is either supported under SP or refused by name."""

from __future__ import annotations

import pytest

from hf_longctx.integrations.trl import support

REFUSED = sorted(name for name, verdict in support.REGISTRY.items() if not verdict.supported)


def _trl_class(name: str, base: type = object) -> type:
    """A stand-in class named like a TRL trainer, defined in a `trl` module."""
    return type(name, (base,), {"__module__": "trl.experimental.fake"})


@pytest.mark.parametrize("name", REFUSED)
def test_refused_trainer_error_names_it_and_what_works(name):
    with pytest.raises(NotImplementedError) as err:
        support.check_trainer_class(_trl_class(name))
    message = str(err.value)
    assert message.startswith(f"{name} is not supported with hf_longctx sequence parallelism")
    supported = "DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer"
    works = f"What works under SP: transformers' Trainer (and subclasses), {supported}"
    assert works in message


def test_real_trl_trainers_are_judged_by_their_own_class():
    from transformers import Trainer
    from trl import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer

    for cls in (SFTTrainer, RewardTrainer, GRPOTrainer, DPOTrainer):
        assert support.trainer_verdict(cls) == (cls.__name__, support.REGISTRY[cls.__name__])
        assert support.check_trainer_class(cls).supported
    for cls in (KTOTrainer, RLOOTrainer):
        with pytest.raises(NotImplementedError, match=f"^{cls.__name__} is not supported"):
            support.check_trainer_class(cls)
    assert support.trainer_verdict(Trainer) == ("Trainer", support.Support(True))


def test_subclasses_inherit_the_verdict_of_the_nearest_trl_class():
    from trl import SFTTrainer

    class MySFT(SFTTrainer):
        pass

    assert support.trainer_verdict(MySFT)[0] == "SFTTrainer"
    # A TRL trainer built on SFTTrainer (GKD, GOLD) is judged by itself, not by SFTTrainer.
    gkd = _trl_class("GKDTrainer", SFTTrainer)
    with pytest.raises(NotImplementedError, match="^GKDTrainer"):
        support.check_trainer_class(type("MyGKD", (gkd,), {}))


def test_unknown_trl_trainer_is_refused_and_generic_base_is_not():
    with pytest.raises(NotImplementedError, match="^NewRLTrainer is not supported.*has not checked"):
        support.check_trainer_class(_trl_class("NewRLTrainer"))
    from trl.trainer.base_trainer import _BaseTrainer

    own = type("MyTrainer", (_BaseTrainer,), {})
    assert support.trainer_verdict(own) == ("Trainer", support.Support(True))


@pytest.mark.parametrize("name", ["GRPOTrainer", "DPOTrainer", "RewardTrainer"])
def test_per_sequence_trainers_are_supported_through_their_setup(name):
    assert support.REGISTRY[name].supported and support.REGISTRY[name].setup is not None


def test_plain_trainer_with_a_sequence_classification_model_is_refused():
    from types import SimpleNamespace

    from transformers import Trainer

    model = type("LlamaForSequenceClassification", (), {})()
    trainer = type("MyTrainer", (Trainer,), {"__init__": lambda self: None})()
    trainer.model = model
    with pytest.raises(NotImplementedError, match="^Trainer with LlamaForSequenceClassification is not supported"):
        support.check_trainer(trainer, SimpleNamespace())
    trainer.model = type("LlamaForCausalLM", (), {})()
    support.check_trainer(trainer, SimpleNamespace())

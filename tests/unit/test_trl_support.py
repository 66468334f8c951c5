"""The TRL trainer registry: every trainer is either supported under SP or refused by name."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from hf_longctx.integrations.trl import support

# Read from the registry, so a trainer that gains an SP path (DPO) moves from one list to the other.
REFUSED = sorted(name for name, verdict in support.REGISTRY.items() if not verdict.supported)
SUPPORTED = sorted(name for name, verdict in support.REGISTRY.items() if verdict.supported)


def _trl_class(name: str, base: type = object) -> type:
    """A stand-in class named like a TRL trainer, defined in a `trl` module."""
    return type(name, (base,), {"__module__": "trl.experimental.fake"})


@pytest.mark.parametrize("name", REFUSED)
def test_refused_trainer_error_names_it_and_what_works(name):
    with pytest.raises(NotImplementedError) as err:
        support.check_trainer_class(_trl_class(name))
    _assert_names(str(err.value), name)


def _assert_names(message: str, name: str) -> None:
    """The refusal names the trainer first, then everything that works under SP."""
    assert message.startswith(f"{name} is not supported with hf_longctx sequence parallelism"), message
    works = message.split("What works under SP: ", 1)[1]
    assert works.startswith("transformers' Trainer (and subclasses), ")
    assert all(supported in works for supported in SUPPORTED) and name not in works


def _shipped_trl_trainers() -> dict[str, type]:
    """Every `*Trainer` class defined in a `*_trainer` module of the installed TRL (`trl.trainer` and each
    `trl.experimental` package), by name; modules whose optional dependencies are missing are left out."""
    import trl.experimental
    import trl.trainer

    modules = [f"trl.trainer.{m.name}" for m in pkgutil.iter_modules(trl.trainer.__path__)]
    for package in pkgutil.iter_modules(trl.experimental.__path__):
        if package.ispkg:
            path = [f"{trl.experimental.__path__[0]}/{package.name}"]
            modules += [f"trl.experimental.{package.name}.{m.name}" for m in pkgutil.iter_modules(path)]
    found: dict[str, type] = {}
    for name in (m for m in modules if m.endswith("_trainer")):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, value in vars(module).items():
            if isinstance(value, type) and attr.endswith("Trainer") and value.__module__ == name:
                found[attr] = value
    return found


@pytest.mark.filterwarnings("ignore:You are importing from 'trl.experimental'")
def test_every_trainer_trl_ships_is_supported_or_refused_by_name():
    shipped = _shipped_trl_trainers()
    # The registry is not stale: most of its refusals are trainers this TRL ships (the rest: older TRLs).
    assert len(set(REFUSED) & set(shipped)) >= len(REFUSED) // 2, sorted(shipped)
    for name, cls in shipped.items():
        judged, verdict = support.trainer_verdict(cls)
        if name in ("_BaseTrainer", "BaseTrainer"):
            assert judged == "Trainer"  # the generic base a user's own trainer builds on
        elif name in SUPPORTED:
            assert (judged, support.check_trainer_class(cls)) == (name, support.REGISTRY[name])
        else:
            with pytest.raises(NotImplementedError) as err:
                support.check_trainer_class(cls)
            _assert_names(str(err.value), name)


def test_real_trl_trainers_are_judged_by_their_own_class():
    from transformers import Trainer
    from trl import DPOTrainer, GRPOTrainer, KTOTrainer, RewardTrainer, RLOOTrainer, SFTTrainer

    for cls in (SFTTrainer, RewardTrainer, GRPOTrainer, DPOTrainer, KTOTrainer, RLOOTrainer):
        assert support.trainer_verdict(cls) == (cls.__name__, support.REGISTRY[cls.__name__])
        if cls.__name__ in SUPPORTED:
            assert support.check_trainer_class(cls).supported
        else:
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
    with pytest.raises(NotImplementedError, match="^NewRLTrainer is not supported.*has not checked") as err:
        support.check_trainer_class(_trl_class("NewRLTrainer"))
    _assert_names(str(err.value), "NewRLTrainer")
    from trl.trainer.base_trainer import _BaseTrainer

    own = type("MyTrainer", (_BaseTrainer,), {})
    assert support.trainer_verdict(own) == ("Trainer", support.Support(True))


@pytest.mark.parametrize("name", ["GRPOTrainer", "DPOTrainer", "RewardTrainer", "KTOTrainer"])
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

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


def _trainer(name: str = "Trainer") -> object:
    """An unconstructed `transformers.Trainer` subclass instance, judged as `name` (a TRL trainer unless "Trainer")."""
    from transformers import Trainer

    namespace = {"__init__": lambda self: None}
    if name != "Trainer":
        namespace["__module__"] = "trl.trainer.fake"
    return type(name, (Trainer,), namespace)()


def _model(cls: type | str) -> object:
    """An instance of `cls` (or of a stand-in class of that name) with a config, as check_trainer reads it."""
    cls = type(cls, (), {}) if isinstance(cls, str) else cls
    model = cls.__new__(cls)
    model.__dict__["config"] = object()
    return model


@pytest.mark.parametrize(
    "trainer_name, model_class, refusal",
    [
        ("Trainer", "LlamaForCausalLM", None),
        ("Trainer", "GPT2LMHeadModel", None),
        ("Trainer", "Qwen2_5_VLForConditionalGeneration", None),
        ("Trainer", "LlamaForTokenClassification", None),
        ("Trainer", "Qwen3ForQuestionAnswering", None),
        ("Trainer", "LlamaForSequenceClassification", "sequence classification pools the last token"),
        ("Trainer", "LlamaModel", "LlamaModel carries none of them"),
        ("Trainer", "LlamaForMaskedLM", "LlamaForMaskedLM carries none of them"),
        ("SFTTrainer", "LlamaForTokenClassification", "token classification model trains under SP with transformers"),
        ("DPOTrainer", "MistralForQuestionAnswering", "question answering model trains under SP with transformers"),
    ],
)
def test_heads_outside_the_allowlist_are_refused_by_class_name(trainer_name, model_class, refusal):
    from types import SimpleNamespace

    trainer = _trainer(trainer_name)
    trainer.model = _model(model_class)
    if refusal is None:
        support.check_head(trainer_name, trainer.model, support.Support(True))
        return
    with pytest.raises(NotImplementedError, match=f"^{trainer_name} with {model_class} is not supported") as err:
        support.check_head(trainer_name, trainer.model, support.Support(True))
    assert refusal in str(err.value)
    if trainer_name == "Trainer":  # what Trainer.__init__ runs (`_validate_args`)
        with pytest.raises(NotImplementedError, match=f"^Trainer with {model_class} is not supported"):
            support.check_trainer(trainer, SimpleNamespace())


def test_a_user_subclass_is_judged_by_its_transformers_head():
    from transformers import LlamaForCausalLM, LlamaForTokenClassification, LlamaModel

    from hf_longctx.sequence import heads

    mine = type("MyTagger", (LlamaForTokenClassification,), {})
    assert heads.head_of(_model(mine)) == (heads.TOKEN_CLASSIFICATION, "LlamaForTokenClassification")
    assert heads.head_of(_model(type("Mine", (LlamaForCausalLM,), {})))[0] == heads.CAUSAL_LM
    assert heads.head_of(_model(LlamaModel)) == (None, "LlamaModel")
    assert heads.label_kind(_model(mine)) == "per_token"
    assert heads.label_kind(_model(LlamaForCausalLM)) == "next_token"


def test_every_token_classification_and_qa_class_transformers_registers_is_known():
    """transformers' own auto-class registries decide, so a family added upstream is covered without a change."""
    from transformers.models.auto import modeling_auto

    from hf_longctx.sequence import heads

    for mapping, kind in (
        (modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, heads.TOKEN_CLASSIFICATION),
        (modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES, heads.QUESTION_ANSWERING),
    ):
        for name in mapping.values():
            assert heads.kind_of_class_name(name) == kind, name

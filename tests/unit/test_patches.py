"""The Trainer patches: an allow-list of targets, idempotent, and fully reversible."""

from __future__ import annotations

from transformers import Trainer

from hf_longctx._patching import PATCH_MARKER, Patch
from hf_longctx.integrations import trainer as sp_trainer

# Every attribute hf_longctx may replace outside its own objects. A new target must be added here on purpose.
ALLOWED = {"get_sp_size", "get_total_train_batch_size", "_validate_args", "training_step", "prediction_step"}


def test_patch_targets_are_allow_listed_idempotent_and_reversible():
    from trl import SFTTrainer  # noqa: F401  (a loaded subclass that overrides prediction_step)

    sp_trainer.remove_trainer_patches()  # constructing an SP config installs them (config.py)
    originals = {name: Trainer.__dict__[name] for name in ALLOWED}
    try:
        first = sp_trainer.install_trainer_patches()
        second = sp_trainer.install_trainer_patches()
        assert {p.name for p in first} <= ALLOWED
        assert [(p.owner, p.name) for p in first] == [(p.owner, p.name) for p in second]
        for patch in first:
            current = patch.owner.__dict__[patch.name]
            assert getattr(current, PATCH_MARKER) and current.__wrapped__ is patch.original
        owners = {p.owner.__name__ for p in first if p.name == "prediction_step"}
        assert {"Trainer", "SFTTrainer"} <= owners
    finally:
        sp_trainer.remove_trainer_patches()
    for name, original in originals.items():
        assert Trainer.__dict__[name] is original


def test_patch_on_missing_attribute_raises():
    class Empty:
        pass

    try:
        Patch(Empty, "nothing", lambda f: f).apply()
    except ValueError as err:
        assert "nothing" in str(err)
    else:
        raise AssertionError("patching a missing attribute must raise")


def test_gated_patches_leave_plain_trainers_alone(tmp_path):
    """With patches installed, a Trainer without hf_longctx SP gets exactly what the originals return."""
    import torch
    from transformers import TrainingArguments

    from tests._models import tiny_model

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2)
    trainer = Trainer(model=tiny_model("llama"), args=args)
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its first training_step
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}
    expected = {
        "get_sp_size": Trainer.get_sp_size(trainer),
        "get_total_train_batch_size": Trainer.get_total_train_batch_size(trainer, args),
        "_validate_args": Trainer._validate_args(trainer),
        "training_step": Trainer.training_step(trainer, trainer.model, dict(inputs)),
        "prediction_step": Trainer.prediction_step(trainer, trainer.model, dict(inputs), False),
    }
    try:
        patches = {p.name: p for p in sp_trainer.install_trainer_patches() if p.owner is Trainer}
        assert set(patches) == set(expected)
        assert sp_trainer.sp_state(trainer) is None
        got = {
            "get_sp_size": trainer.get_sp_size(),
            "get_total_train_batch_size": trainer.get_total_train_batch_size(args),
            "_validate_args": trainer._validate_args(),
            "training_step": trainer.training_step(trainer.model, dict(inputs)),
            "prediction_step": trainer.prediction_step(trainer.model, dict(inputs), False),
        }
        for name in expected:
            assert Trainer.__dict__[name] is not patches[name].original  # the patched method ran
    finally:
        sp_trainer.remove_trainer_patches()
    assert got["get_sp_size"] == expected["get_sp_size"] == 1
    assert got["get_total_train_batch_size"] == expected["get_total_train_batch_size"] == 2
    assert torch.equal(got["training_step"], expected["training_step"])
    for value, want in zip(got["prediction_step"], expected["prediction_step"], strict=True):
        assert torch.equal(value, want)


def test_instance_patch_remove_restores_the_class_method():
    import torch

    layer = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    expected = layer(x)
    patch = Patch(layer, "forward", lambda original: lambda inp: original(inp) * 0)
    patch.apply()
    assert "forward" in vars(layer) and bool((layer(x) == 0).all())
    patch.remove()
    # Gone from the instance, not re-set to the bound method: later class-level changes reach it again.
    assert "forward" not in vars(layer)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def test_patch_of_an_instance_attribute_of_its_own_is_put_back():
    class Holder:
        pass

    holder = Holder()
    holder.fn = original = lambda: 1
    patch = Patch(holder, "fn", lambda f: lambda: f() + 1)
    patch.apply()
    assert holder.fn() == 2
    patch.remove()
    assert vars(holder)["fn"] is original


def test_instance_patch_over_a_patched_class_method_applies_and_is_removed():
    """An instance reading a class method patched by hf_longctx is not itself patched: its own patch applies."""

    class Owner:
        def step(self) -> int:
            return 1

    class_patch = Patch(Owner, "step", lambda original: lambda self: original(self) + 10)
    class_patch.apply()
    owner = Owner()
    instance_patch = Patch(owner, "step", lambda original: lambda: original() * 2)
    try:
        instance_patch.apply()
        instance_patch.apply()  # idempotent on the instance
        assert owner.step() == 22
    finally:
        instance_patch.remove()
        class_patch.remove()
    assert "step" not in vars(owner) and owner.step() == 1

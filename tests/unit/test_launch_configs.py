"""The accelerate configs and recipes the README documents can start together.

transformers' Trainer refuses `gradient_checkpointing=True` together with FSDP's own activation
checkpointing ("The activation_checkpointing in FSDP config and the gradient_checkpointing in training arg
can't be set to True simultaneously"); every recipe is documented with every FSDP config, so no FSDP config
may turn on `fsdp_activation_checkpointing` while a recipe turns on `gradient_checkpointing`.
"""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _load(folder: str) -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / folder).glob("*.yaml"))}


def test_fsdp_configs_leave_activation_checkpointing_to_the_recipes():
    configs, recipes = _load("configs"), _load("recipes")
    # transformers 5.24 renamed gradient_checkpointing to activation_checkpointing (the old name still works).
    checkpointing = [
        name for name, r in recipes.items() if r.get("gradient_checkpointing") or r.get("activation_checkpointing")
    ]
    fsdp = {name: c for name, c in configs.items() if c.get("distributed_type") == "FSDP"}
    assert fsdp, "no FSDP config found"
    assert checkpointing, "no recipe uses gradient_checkpointing"
    for name, config in fsdp.items():
        assert not config["fsdp_config"].get("fsdp_activation_checkpointing"), (name, checkpointing)


def test_every_config_and_recipe_parses():
    for name, data in {**_load("configs"), **_load("recipes")}.items():
        assert isinstance(data, dict) and data, name

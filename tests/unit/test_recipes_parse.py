"""Every recipe YAML parses with the parser of the script its header names (a recipe that stops at its first line,
e.g. a TrainingArguments field a transformers release removed, fails here, not on a GPU). transformers 5 removed
`warmup_ratio`, which six GPU recipes still set. transformers 5.25 deprecates `gradient_checkpointing` for
`activation_checkpointing`: the recipes use the new name, and it turns checkpointing on."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from yaml import safe_load as yaml_load

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
PARSERS = {
    "sft": ("LongContextArguments", "SFTConfig"),
    "dpo": ("DPORecipeArguments", "DPOConfig"),
    "reward": ("RewardRecipeArguments", "RewardConfig"),
    "grpo": ("GRPORecipeArguments", "GRPOConfig"),
}


def _script(yaml: Path) -> str:
    match = re.search(r"recipes/(\w+)\.py --config recipes/" + re.escape(yaml.name), yaml.read_text())
    assert match, f"{yaml.name}: its header names no `recipes/<script>.py --config recipes/{yaml.name}` command"
    return match.group(1)


@pytest.mark.parametrize("yaml", RECIPES, ids=lambda p: p.name)
def test_recipe_yaml_parses_with_its_script(yaml, monkeypatch):
    import trl
    from trl import TrlParser

    name = _script(yaml)
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))  # the scripts import their folder's _weights
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    recipe_args, config = PARSERS[name]
    # GPU recipes train in bf16, which TrainingArguments refuses on this CPU: parsed with bf16 off.
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--config", str(yaml), "--bf16", "false"])
    parsed = TrlParser((getattr(module, recipe_args), getattr(trl, config))).parse_args_and_config()
    assert parsed[1].output_dir
    recipe = yaml_load(yaml.read_text())
    assert "gradient_checkpointing" not in recipe, f"{yaml.name}: use activation_checkpointing (transformers 5.25)"
    if recipe.get("activation_checkpointing"):
        assert parsed[1].gradient_checkpointing, "activation_checkpointing: true must turn checkpointing on"

"""Shared pytest setup: offline Hugging Face environment, one torch thread, `gpu` and `slow` marker handling, and
recipes/sft.py as a module (`sft_recipe`)."""

from __future__ import annotations

import os
from types import ModuleType

import pytest

# Tests never reach the hub: tiny models and data are built in-process or shipped with the package.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_var] = "1"
# One intra-op thread in this process and every process it starts, set before anything imports torch: on a
# 2-core machine shared with other jobs, OpenMP threads spin against them (a unit test took 22 s at load 9 that
# takes 0.1 s alone). The gloo ranks already run one thread each (tests/_dist.py).
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-slow",
        action="store_true",
        default=False,
        help="skip tests marked `slow` (they run by default, and in CI)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = config.getoption("--skip-slow")
    has_gpu_tests = any(item.get_closest_marker("gpu") for item in items)
    cuda = False
    if has_gpu_tests:
        import torch

        cuda = torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("gpu") and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if skip_slow and item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="slow test skipped by --skip-slow"))


@pytest.fixture
def sft_recipe(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """recipes/sft.py imported as a module (its `recipes/` imports resolved), gone from `sys.modules` after."""
    import importlib.util
    import sys
    from pathlib import Path

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    monkeypatch.syspath_prepend(str(recipes))
    spec = importlib.util.spec_from_file_location("recipe_sft", recipes / "sft.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module

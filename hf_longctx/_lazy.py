"""Lazy re-exports for package `__init__` modules (PEP 562).

A package lists `name -> submodule` and gets a module `__getattr__` that imports the submodule on
first use, so `import hf_longctx` (or `import hf_longctx.planner`) costs nothing until a name that
needs torch is touched: `hf-longctx plan --help` must not import torch, transformers or accelerate.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Module `__getattr__` and `__dir__` for `package` resolving each name from its submodule.

    Args:
        package: the package's `__name__`.
        exports: public name -> module (absolute, or relative to `package` when it starts with ".").

    Returns:
        `(__getattr__, __dir__)` to assign in the package's namespace.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__

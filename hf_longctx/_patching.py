"""Reversible, idempotent attribute patches: the only monkeypatching mechanism of hf_longctx.

It sits below every package (it imports nothing of hf_longctx): the attention layer patches
linear-attention layers' `forward` with it and the integrations patch Trainer methods with it.

`Patch(owner, name, make)` replaces `owner.name` by `make(original)`; `apply()` twice is a no-op
(a marker on the replacement), `remove()` restores the exact original object, and the
replacement keeps `__wrapped__`. Used for the few Trainer methods that have no registry, and on
instances (a model's or a layer's `forward`): there `remove()` deletes the instance attribute again, so
the object reads its class's method exactly as before.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
PATCH_MARKER = "_hf_longctx_patch"


class Patch:
    """One attribute replacement on a class (or any object), undone by `remove()`."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self.owner, self.name, self.make = owner, name, make
        self.original: Any = None
        self.applied = False
        self._owned = False  # whether the owner itself held the attribute (not only its class)

    def apply(self) -> None:
        """Install the replacement unless this owner's attribute is already patched."""
        current = self.owner.__dict__.get(self.name) if isinstance(self.owner, type) else getattr(self.owner, self.name)
        if current is None:
            raise ValueError(f"{self.owner!r} defines no {self.name!r} to patch.")
        # Only the owner's own attribute counts as patched: an instance reading a patched class method is not.
        own = current if isinstance(self.owner, type) else getattr(self.owner, "__dict__", {}).get(self.name)
        if getattr(own, PATCH_MARKER, False):
            return
        replacement = functools.wraps(current)(self.make(current))
        setattr(replacement, PATCH_MARKER, True)
        self.original = current
        self._owned = isinstance(self.owner, type) or self.name in getattr(self.owner, "__dict__", {})
        setattr(self.owner, self.name, replacement)
        self.applied = True
        logger.info("hf_longctx: patched %s.%s", getattr(self.owner, "__name__", self.owner), self.name)

    def remove(self) -> None:
        """Restore the original attribute (no-op if this patch did not install it)."""
        if self.applied:
            if self._owned:
                setattr(self.owner, self.name, self.original)
            else:
                # The instance read the attribute from its class: storing the bound original would pin it.
                delattr(self.owner, self.name)
            self.applied = False

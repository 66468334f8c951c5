"""`Patch` under its former name: it lives in `hf_longctx/_patching.py`, below every package.

Kept while `integrations/trl/grpo.py` still imports it from here; that import moves to
`hf_longctx._patching` with the next change to grpo.py, and this module goes then.
"""

from hf_longctx._patching import PATCH_MARKER, Patch

__all__ = ["PATCH_MARKER", "Patch"]

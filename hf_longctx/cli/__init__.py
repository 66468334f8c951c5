"""The `hf-longctx` command line: `main.py` dispatches to `check`, `plan.py` and `demo.py`."""

from hf_longctx.cli.main import main

__all__ = ["main"]

"""Sequence-parallel attention: Ulysses (`ulysses.py`), kernel inputs (`kernels.py`), registration (`registry.py`)."""

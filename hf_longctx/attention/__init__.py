"""Sequence-parallel attention.

Ulysses (`ulysses.py`), ring attention and Ulysses x ring (`ring/`, on the block kernels that return the
log-sum-exp in `lse/`, which `tiled_layer` shares), the backend choice (`backends.py`, `auto.py`,
`cost.py`), kernel inputs (`kernels.py`) and registration (`registry.py`). `linear/`: linear-attention
layers (Gated DeltaNet) head-parallel, and the check that refuses other token mixers by name.
"""

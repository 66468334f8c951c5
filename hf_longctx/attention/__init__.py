"""Sequence-parallel attention.

Ulysses (`ulysses.py`), ring attention (`ring.py`, planned by `ring_plan.py` on the LSE kernels of
`lse_kernels.py`), Ulysses x ring (`hybrid.py`), the backend choice (`backends.py`, `auto.py`,
`cost.py`), kernel inputs (`kernels.py`) and registration (`registry.py`). `linear/`: linear-attention
layers (Gated DeltaNet) head-parallel, and the check that refuses other token mixers by name.
"""

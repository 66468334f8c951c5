"""Ring attention and Ulysses x ring (hybrid).

`attention.py` is the autograd function over one ring of ranks, planned by the pure `plan.py`
(which query rows meet which keys) on the block kernels of `attention/lse/` (which return the log-sum-exp
and are merged by `attention/lse/merge.py`); `hybrid.py` is the transformers attention function for ring
and hybrid.
"""

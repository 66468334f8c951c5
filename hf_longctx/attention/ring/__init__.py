"""Ring attention and Ulysses x ring (hybrid).

`attention.py` is the autograd function over one ring of ranks, planned by the pure `plan.py`
(which query rows meet which keys, the online-softmax merge) on the LSE-returning kernels of
`lse_kernels.py` (its CUDA adapters, flash-attn detection and the varlen path for packed blocks in
`cuda_kernels.py`); `hybrid.py` is the transformers attention function for ring and hybrid.
"""

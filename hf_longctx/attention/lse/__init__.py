"""Block attention kernels that return the log-sum-exp (LSE), merged block by block by ring attention
(`attention/ring/`) and by `tiled_layer`'s tile attention (`memory/tile_attention.py`): one set of kernels for both.

`choose.select_kernel(q, plan)` / `choose.choose_kernel(...)` is the main entry; `contract.py` states the layout
every kernel takes and returns, `merge.py` folds a block's result into the running one. CPU: torch's CPU flash
kernel (`cpu.py`). CUDA: torch's own FlashAttention-2 for dense and packed fp16/bf16 blocks (`torch_flash.py`),
torch's memory-efficient kernel for masked and fp32 blocks (`efficient.py`), flash-attn 2/3 when installed
(`flash_attn.py`); the math kernel elsewhere.
"""

"""Token mixers outside softmax attention under sequence parallelism: linear attention, head-parallel.

`support.py` says which layer classes SP shards (Qwen3-Next's Gated DeltaNet, `gated_deltanet.py`) and
refuses every other recurrent, state-space or convolutional mixer by name; `attention/registry.py`
runs its check in `check_model` and attaches the adapters in `enable_sequence_parallel`.
"""

"""Model families whose token mixing or inputs need more than the attention registry under SP.

`vision` owns vision-language models (the vision tower on full images, features merged on the full
sequence, then sliced to the rank's shard); `linear_attention` owns head-parallel linear-attention and
state-space layers (all-to-all to head shards, the layer's own kernel on the whole sequence).
"""

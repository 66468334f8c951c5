"""Model families whose token mixing or inputs need more than the attention registry under SP.

Vision-language models (the vision tower runs on the full images, its features merge into the embeddings of the
full sequence before the shard is cut) and linear-attention / state-space layers (a head-parallel exchange around
the layer's own kernel) live here, one module per family.
"""

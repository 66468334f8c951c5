"""Query-block limits of masked sdpa / eager attention, torch-free so the planner can import them.

`kernels.plan_blocks` cuts a masked attention into blocks of queries with these limits;
`planner.terms.eager_scores` counts the score elements those blocks hold.
"""

# Largest `[q_block, keys]` mask (elements) a masked sdpa / eager block may take: eager's scores
# are this times the local heads, so memory stays bounded however long the document is.
MASK_BLOCK_ELEMENTS = 2**22
MIN_Q_BLOCK = 64

"""The online-softmax merge of block results (`merge_block`): ring attention and tile attention fold every
block's (out, LSE) into one running fp32 (fp64 for fp64 inputs) result with it."""

from __future__ import annotations

import torch


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, rows: slice):
    """Fold one block's result into the running `out` `[bs, hc, sq, hs]` / `lse` `[bs, hc, sq]` (in place).

    L = logaddexp(L_a, L_b), O = exp(L_a - L) O_a + exp(L_b - L) O_b. A row whose block LSE is -inf (or +inf)
    saw no key in this block: its block output is ignored (selected away, never multiplied by 0, so
    a NaN or garbage output from a kernel on an empty row cannot leak), and rows where both sides are
    -inf keep O = 0 and L = -inf instead of NaN.
    """
    run_out, run_lse = out[:, :, rows], lse[:, :, rows]
    # +inf is how FlashAttention-2 marks a row without keys (softmax.h); no plan hands it one, but read it as empty.
    block_lse = block_lse.masked_fill(block_lse == float("inf"), float("-inf"))
    new = torch.logaddexp(run_lse, block_lse)
    safe = new.masked_fill(new == float("-inf"), 0.0)
    run_out.mul_(torch.exp(run_lse - safe).unsqueeze(-1))
    seen = (block_lse != float("-inf")).unsqueeze(-1)
    contribution = block_out.to(out.dtype) * torch.exp(block_lse - safe).unsqueeze(-1)
    run_out.add_(torch.where(seen, contribution, torch.zeros((), dtype=out.dtype, device=out.device)))
    run_lse.copy_(new)

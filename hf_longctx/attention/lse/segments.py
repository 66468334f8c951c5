"""A packed block as varlen segments: the input of the varlen kernels (`Segments`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """A packed block as varlen segments: every (batch row, document) pair that meets keys in it.

    Tokens are numbered row-major over the crop (query `b * nrows + i`, key `b * ncols + j`);
    `q_tokens` / `k_tokens` list the participating ones segment after segment, bounded by `cu_q` /
    `cu_k` (int32, from 0; on the tokens' device). Every segment is fully visible (`causal=False`) or
    square causal over the same positions (`causal=True`). Query rows of no segment see no key: they
    are never computed, so their out is 0 and their LSE -inf by construction."""

    q_tokens: torch.Tensor
    k_tokens: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool

    def mask(self, bs: int, nrows: int, ncols: int) -> torch.Tensor:
        """The dense boolean `[bs, 1, nrows, ncols]` these segments stand for (for mask kernels).

        Built from the listed (query, key) pairs, so a key listed in several segments (several runs of one
        document's queries see it) is visible to each of them."""
        lq, lk = (self.cu_q[1:] - self.cu_q[:-1]).long(), (self.cu_k[1:] - self.cu_k[:-1]).long()
        device = self.q_tokens.device
        per_segment = lq * lk
        seg = torch.repeat_interleave(torch.arange(lq.numel(), device=device), per_segment)
        within = torch.arange(int(per_segment.sum()), device=device) - (per_segment.cumsum(0) - per_segment)[seg]
        qi, kj = within // lk[seg], within % lk[seg]
        if self.causal:  # square segments over the same positions
            keep = kj <= qi
            seg, qi, kj = seg[keep], qi[keep], kj[keep]
        q_tok = self.q_tokens[self.cu_q[:-1].long()[seg] + qi]
        k_tok = self.k_tokens[self.cu_k[:-1].long()[seg] + kj]
        mask = torch.zeros(bs, nrows, ncols, dtype=torch.bool, device=device)
        mask[q_tok // nrows, q_tok % nrows, k_tok % ncols] = True
        return mask.unsqueeze(1)

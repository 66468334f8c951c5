"""The documents of a batch as a run without packing would see them one by one: pure functions, no collectives.

A packed row holds several documents (positions restarting, `data.sharding.document_starts`); attention already
keeps them apart. What a layer computes from "the sequence" at run time must follow the document too:
`index_in_document` gives each token its index in its own document (Llama 4's temperature), `document_runs`
groups this rank's tokens by document for the run-time rotary modules (`rope.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_longctx.data.sharding import document_starts
from hf_longctx.sequence.view import ShardView


def index_in_document(positions: torch.Tensor) -> torch.Tensor:
    """`[bs, sl]` index of every token in its own document (0 at each document's first token).

    A document is what the attention keeps apart (a new one wherever the positions do not advance by one), so
    this is the index `arange` gives when the document is run alone, whatever position its row starts at.
    """
    sl = positions.shape[-1]
    index = torch.arange(sl, device=positions.device).expand_as(positions)
    first = torch.where(document_starts(positions), index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


@dataclass(frozen=True)
class DocumentRuns:
    """This rank's tokens grouped by consecutive documents of one length, in the batch's document order.

    The documents of the whole batch (row after row, each row's in order) are cut into runs of consecutive
    documents whose largest real position is the same: a run-time rotary module given one of them or all of them
    picks the same frequencies (as for a document repeated twice). SP padding belongs to its row's last document.
    A one-token document (position 0 alone) joins the run before it: it carries no loss, and padding whose
    positions restart at 0 (TRL's collator pads `position_ids` with 0) is made of them.
    """

    largest: list[int]  # per run: the largest real position of its documents (a document alone reads it + 1)
    tokens: list[torch.Tensor]  # per run: this rank's tokens in it, as flat indices into `[bs * sl_l]`
    real: torch.Tensor  # `[bs * sl_l]` False for SP padding
    packed: bool  # some row holds more than one document of several tokens

    def __len__(self) -> int:
        return len(self.largest)


def document_runs(view: ShardView) -> DocumentRuns:
    """Group this rank's tokens of `view` (one forward) into `DocumentRuns`."""
    positions = view.positions.long()
    bs, sl = positions.shape
    device = positions.device
    real = torch.arange(sl, device=device) < view.length  # [sl]
    starts = document_starts(positions) & real  # SP padding never starts a document
    per_row = starts.sum(dim=1)
    offset = torch.cumsum(per_row, 0) - per_row  # documents in the rows before
    doc = starts.long().cumsum(dim=1) - 1 + offset[:, None]  # [bs, sl] document index in the batch
    masked = torch.where(real, positions, torch.full_like(positions, -1))
    largest = torch.full((int(per_row.sum()),), -1, dtype=torch.long, device=device)
    largest = largest.scatter_reduce(0, doc.flatten(), masked.flatten(), reduce="amax")
    # One-token documents take the length of the counted document before them (the first one's, at the start).
    counted = largest > 0
    if not bool(counted.any()):
        counted = torch.ones_like(counted)
    index = torch.arange(largest.numel(), device=device)
    before = torch.where(counted, index, torch.full_like(index, -1)).cummax(dim=0).values
    before = torch.where(before < 0, torch.nonzero(counted)[0], before)
    key = largest[before]
    new_run = torch.ones_like(key, dtype=torch.bool)
    new_run[1:] = key[1:] != key[:-1]
    run_of_doc = new_run.long().cumsum(0) - 1
    # This rank's tokens: [bs, sl_l] -> run index, then grouped by run (stable: in sequence order within a run).
    local = view.local_index.to(device)
    run = run_of_doc[doc[:, local]].flatten()
    order = torch.argsort(run, stable=True)
    counts = torch.bincount(run, minlength=int(new_run.sum())).tolist()
    counted_per_row = torch.zeros(bs, dtype=torch.long, device=device).index_add_(
        0, torch.repeat_interleave(torch.arange(bs, device=device), per_row), counted.long()
    )
    return DocumentRuns(
        largest=key[new_run].tolist(),
        tokens=list(order.split(counts)),
        real=real[local].expand(bs, -1).flatten(),
        packed=bool((counted_per_row > 1).any()),
    )

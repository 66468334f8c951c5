"""No `[sl, sl]` tensor: the largest tensor a packed-row training step allocates grows linearly in the
row length on sdpa and eager (sliding windows and chunked layers included), and documents stay exact.

The largest allocation is the largest output of any aten op during forward + backward, recorded by a
`TorchDispatchMode`. Rows hold documents of a fixed length, so a dense document mask would grow 16x
when the row grows 4x; everything that is per token grows 4x.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import hf_longctx
from tests._models import tiny_model

DOC = 64  # tokens per packed document
SHORT, LONG = 4 * DOC, 16 * DOC


class LargestTensor(TorchDispatchMode):
    """Records the byte size of the largest tensor any aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _step(model, sl: int) -> tuple[int, torch.Tensor]:
    """Largest tensor of one forward + backward on a row of `sl // DOC` packed documents."""
    ids = torch.randint(1, 128, (1, sl), generator=torch.Generator().manual_seed(sl))
    positions = torch.arange(sl).remainder(DOC).unsqueeze(0)
    with LargestTensor() as mode:
        logits = model(input_ids=ids, position_ids=positions).logits
        loss = F.cross_entropy(logits[0, :-1], ids[0, 1:])
        loss.backward()
    model.zero_grad(set_to_none=True)
    return mode.largest, logits.detach()


@pytest.mark.parametrize(
    "arch,attn",
    [("llama", "sdpa"), ("llama", "eager"), ("gemma2", "eager"), ("llama4", "sdpa")],
    ids=["sdpa", "eager", "eager-sliding-window", "sdpa-chunked"],
)
def test_largest_allocation_grows_linearly_and_documents_stay_exact(arch, attn):
    model = tiny_model(arch, attn=attn, hidden=32, num_heads=2, num_kv_heads=1, vocab=128)
    # The model's own code would build a [1, 1, sl, sl] mask for the packed row; under hf_longctx the
    # mask registry builds none and the kernel runs per document (block).
    with hf_longctx.enable_sequence_parallel(model, hf_longctx.SequenceParallelGroups.single()):
        short, _ = _step(model, SHORT)
        long, logits = _step(model, LONG)
    assert long <= 4.25 * short, f"largest tensor x{long / short:.1f} for a 4x longer row (quadratic would be 16x)"
    # Exact per document: each document alone through the plain model gives the same logits.
    ids = torch.randint(1, 128, (1, LONG), generator=torch.Generator().manual_seed(LONG))
    with torch.no_grad():
        alone = torch.cat([model(input_ids=ids[:, s : s + DOC]).logits for s in range(0, LONG, DOC)], dim=1)
    torch.testing.assert_close(logits, alone, atol=2e-5, rtol=2e-5)

"""A value hf_longctx made whole on every SP rank stays recognisable (`sequence.replicated`) through the wrappers
that copy a model's outputs: DeepSpeed ZeRO-3's `detach()` (same storage) and DDP's clone with
`find_unused_parameters=True` (the Trainer's default without activation checkpointing). Lost, the SP metric gather
summed the MoE router loss over the SP group (logged `aux_loss` 4.97 against 2.48 at SP=2)."""

from __future__ import annotations

import torch

from tests._dist import run_distributed


class _Outputs(torch.nn.Module):
    """Returns a marked scalar and an unmarked one, both with gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        from hf_longctx.sequence.replicated import mark_replicated

        return {"partial": (self.weight * x).sum(), "whole": mark_replicated((self.weight * x).mean() * 2)}


def _worker(rank: int, world_size: int) -> dict[str, bool]:
    from hf_longctx.sequence.replicated import is_replicated

    out = {}
    for unused in (True, False):
        ddp = torch.nn.parallel.DistributedDataParallel(_Outputs(), find_unused_parameters=unused)
        got = ddp(torch.arange(3.0))
        out[f"unused={unused}"] = (is_replicated(got["whole"]), is_replicated(got["partial"]))
        out[f"unused={unused} sink"] = (
            got["whole"].grad_fn is not None and "DDPSink" in type(got["whole"].grad_fn).__name__
        )
        (got["whole"] + got["partial"]).backward()
    out["detached"] = is_replicated(got["whole"].detach())
    return out


def test_marks_survive_ddp_clones_and_detach():
    (result,) = run_distributed(_worker, 1, timeout=120)
    assert result["unused=True sink"], "DDP no longer clones outputs with find_unused_parameters: drop the node check"
    assert result["unused=True"] == (True, False)
    assert result["unused=False"] == (True, False)
    assert result["detached"]

"""The memory flags with FSDP2 (`fully_shard` directly, `lm_head` its own unit) as the data-parallel engine at
SP=2: the same per-step loss and gradients as one process without SP, flags or FSDP2. DeepSpeed ZeRO-3 with
the flags is in `test_deepspeed.py` (it shares that file's reference run); DDP is the engine of
`test_memory_trainer.py`'s SP=2 runs.
"""

from __future__ import annotations

import torch

from tests._dist import run_distributed

ALL = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}


def _fsdp2(rank: int, world_size: int) -> list[dict[str, object]]:
    """Three SGD steps at SP=2 under FSDP2 with all flags, and in the same process the reference: the same
    model without SP, flags or FSDP2 on the full batch (no collectives)."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hf_longctx
    from hf_longctx.memory import apply_memory_flags
    from tests._models import tiny_model

    model, reference = tiny_model("llama"), tiny_model("llama")
    groups = hf_longctx.SequenceParallelGroups.build(world_size)
    hf_longctx.enable_sequence_parallel(model, groups)
    apply_memory_flags(model, SimpleNamespace(**ALL))
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)  # its own unit: the tiled loss reads it inside its forward
    fully_shard(model, mesh=mesh)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(3):
        ids = torch.randint(0, 128, (1, 45), generator=g)
        shard = hf_longctx.shard_batch({"input_ids": ids, "labels": ids}, groups)
        shift = shard.pop("shift_labels")
        count = shift.ne(-100).sum()
        torch.distributed.all_reduce(count)
        # The model's own loss, Trainer-style: shard sum / global count, x world (FSDP2 averages gradients).
        loss = model(**shard, labels=shift, shift_labels=shift, num_items_in_batch=count).loss * world_size
        loss.backward()
        total = loss.detach() / world_size
        torch.distributed.all_reduce(total)
        ref_loss = reference(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        step = {"loss": total.item(), "ref_loss": ref_loss.item(), "grads": {}, "ref_grads": {}}
        for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            step["grads"][name] = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            step["ref_grads"][name] = r.grad.clone()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        out.append(step)
    return out


def test_fully_shard_with_flags_sp2_matches_single_process():
    for step in run_distributed(_fsdp2, 2, timeout=180)[0]:
        assert abs(step["loss"] - step["ref_loss"]) <= 1e-6 * abs(step["ref_loss"])
        for name, ref in step["ref_grads"].items():
            err = (step["grads"][name] - ref).abs().max() / ref.abs().max()
            assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"

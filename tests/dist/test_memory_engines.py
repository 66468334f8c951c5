"""The memory flags with DeepSpeed ZeRO-1/2/3 (through the Trainer) and FSDP2 (`fully_shard` directly) as
the data-parallel engine at SP=2: the same per-step loss, grad_norm and gradients as one process without
SP and without flags. (DDP is the engine of `test_memory_trainer.py`'s SP=2 runs.)
"""

from __future__ import annotations

import pytest
import torch

from tests._dist import run_distributed

pytest.importorskip("deepspeed", reason="deepspeed is a dev dependency (pip install -e '.[dev]')")

ALL = {"tiled_loss": True, "tiled_mlp": True, "offload_activations": True}


@pytest.mark.slow
@pytest.mark.parametrize("stages", [[3]])  # one engine per process (accelerate); ZeRO-1/2: see the README
def test_zero_stages_with_flags_match_single_process(tmp_path, stages):
    from tests.dist.test_deepspeed import STEPS, _train

    reference = run_distributed(_train, 1, str(tmp_path / "ref"), [None], timeout=300)[0][None]
    results = run_distributed(_train, 2, str(tmp_path / "sp"), stages, ALL, timeout=600)[0]
    for stage, logs in results.items():
        assert len(logs) == len(reference) == STEPS
        for (loss, norm), (ref_loss, ref_norm) in zip(logs, reference, strict=True):
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), f"ZeRO-{stage} loss"
            assert abs(norm - ref_norm) <= 1e-5 * abs(ref_norm), f"ZeRO-{stage} grad_norm"


def _fsdp2(rank: int, world_size: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hf_longctx
    from hf_longctx.data.sharding import shard_batch_for_rank
    from hf_longctx.memory import apply_memory_flags
    from tests._models import tiny_model

    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    sp = world_size > 1
    groups = hf_longctx.SequenceParallelGroups.build(world_size) if sp else hf_longctx.SequenceParallelGroups.single()
    if sp:
        hf_longctx.enable_sequence_parallel(model, groups)
        apply_memory_flags(model, SimpleNamespace(**ALL))
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)  # its own unit: the tiled loss reads it inside its forward
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(3):
        ids = torch.randint(0, 128, (1, 45), generator=g)
        batch = {"input_ids": ids, "labels": ids}
        shard = hf_longctx.shard_batch(batch, groups) if sp else shard_batch_for_rank(batch, 0, 1)
        shift = shard.pop("shift_labels")
        count = shift.ne(-100).sum()
        if sp:
            torch.distributed.all_reduce(count)
        # The model's own loss, Trainer-style: shard sum / global count, x world (FSDP2 averages gradients).
        loss = model(**shard, labels=shift, shift_labels=shift, num_items_in_batch=count).loss * world_size
        loss.backward()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()
        }
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach() / world_size
        if sp:
            torch.distributed.all_reduce(total)
        out.append((total.item(), grads))
    return out


def test_fully_shard_with_flags_sp2_matches_single_process():
    reference = run_distributed(_fsdp2, 1, timeout=120)[0]
    sp = run_distributed(_fsdp2, 2, timeout=180)[0]
    for (loss, grads), (ref_loss, ref_grads) in zip(sp, reference, strict=True):
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        for name, ref in ref_grads.items():
            err = (grads[name] - ref).abs().max() / ref.abs().max()
            assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"

"""FSDP2 (`fully_shard`) as the data-parallel engine under hf_longctx SP, on CPU gloo.

accelerate only switches to FSDP for GPU-like distributed types (`AcceleratorState` leaves MULTI_CPU out), so
this drives `fully_shard` directly:
the reduce-scatter averages gradients over all ranks, which with `sequence_parallel_loss` must give the
single-device gradients. accelerate's own FSDP2 route runs in tests/dist/test_trainer.py (with a test shim).
"""

from __future__ import annotations

import torch

from tests._dist import run_distributed

STEPS = 3


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (1, 45), generator=g) for _ in range(STEPS)]


def _train(rank: int, world_size: int, tiled: bool = False) -> list[tuple[float, dict[str, torch.Tensor]]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import hf_longctx
    from hf_longctx.data.sharding import shard_batch_for_rank
    from tests._models import tiny_model

    model = tiny_model("llama", num_heads=4, num_kv_heads=2)
    sp = world_size > 1
    calls: list[int] = []
    groups = hf_longctx.SequenceParallelGroups.build(world_size) if sp else hf_longctx.SequenceParallelGroups.single()
    if sp:
        hf_longctx.enable_sequence_parallel(model, groups)
        if tiled:  # applied before wrapping, as the Trainer integration does
            from hf_longctx.memory import tiled_layer

            assert len(tiled_layer.enable_tiled_layer(model, 3).layers) == 2
            original = tiled_layer._TiledLayer.run
            tiled_layer._TiledLayer.run = lambda self, *a: calls.append(1) or original(self, *a)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for ids in _batches():
        batch = {"input_ids": ids, "labels": ids}
        shard = hf_longctx.shard_batch(batch, groups) if sp else shard_batch_for_rank(batch, 0, 1)
        shift_labels = shard.pop("shift_labels")
        loss = hf_longctx.sequence_parallel_loss(model(**shard).logits, shift_labels, groups)
        loss.backward()
        grads = {
            n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters()
        }
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), grads))
    assert len(calls) == (2 * STEPS if tiled else 0)  # every layer of every step ran tiled
    return out


def test_fully_shard_sp2_matches_single_process():
    _assert_matches(run_distributed(_train, 2, timeout=180)[0], run_distributed(_train, 1, timeout=120)[0])


def test_fully_shard_sp2_with_tiled_layer_matches_single_process():
    # Every tile (and the K/V recompute in backward) runs inside FSDP2's unshard window of its layer, and each
    # parameter's gradient reaches the reduce-scatter once.
    _assert_matches(run_distributed(_train, 2, True, timeout=180)[0], run_distributed(_train, 1, timeout=120)[0])


def _assert_matches(sp: list, reference: list) -> None:
    for (loss, grads), (ref_loss, ref_grads) in zip(sp, reference, strict=True):
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        for name, ref in ref_grads.items():
            err = (grads[name] - ref).abs().max() / ref.abs().max()
            assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"

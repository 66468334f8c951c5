"""One rank of the two-"node" simulation (torchrun --nnodes 2 on localhost); see test_multinode.py.

SP=4 over 2 nodes x 2 ranks: hybrid 2 x 2 (explicit) and auto on a 4 / 2-head Llama, packed row.
Each rank reports its node (torchrun's GROUP_RANK), the global ranks of its Ulysses and ring groups
and the loss / SP-averaged gradients; rank 0 writes everything to the JSON-free torch file OUT.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import hf_longctx
from tests.dist import _parity as P

SPEC = P.SPECS_BY_ID["llama-gqa4x2-h64"]
RUNS = {"hybrid": {"backend": "hybrid", "ulysses_degree": 2}, "auto": {"backend": "auto"}}


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    groups = hf_longctx.SequenceParallelGroups.build(4)
    node = int(os.environ["GROUP_RANK"])
    results = {"ranks_per_node": groups.ranks_per_node}
    for name, options in RUNS.items():
        model = SPEC.build()
        with hf_longctx.enable_sequence_parallel(model, groups, **options) as handle:
            loss, _ = P._sp_step(model, P.make_case("packed3").batch, groups)
            grads = P._averaged_grads(model, groups)
            hybrid = groups.hybrid(handle.backend.ulysses_degree)
            mine = {"node": node, "ulysses": hybrid.ulysses_ranks, "ring": hybrid.ring_ranks, "loss": loss.item()}
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            results[name] = {
                "backend": (handle.backend.name, handle.backend.ulysses_degree),
                "ranks": everyone,
                "grads": grads,
            }
    if dist.get_rank() == 0:
        torch.save(results, out + ".tmp")
        os.replace(out + ".tmp", out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

"""What each rank of a launched job is, written to files for tests/dist/test_launch.py to read.

The test cannot ask a launched job how many jobs it is; every rank tells it instead: at process start its
`WORLD_SIZE` (from its launcher, before any rendezvous, so two separate jobs show up at once, not after a hang),
and after the first step's checks its SP and DP groups as global ranks. The "node" is the one the test started
(HF_LONGCTX_TEST_NODE), not one the job computed, so SP groups inside a node are checked against the truth.
"""

from __future__ import annotations

import json
import os
from typing import Any


def _write(folder: str, kind: str, record: dict[str, Any]) -> None:
    """One JSON file per process and kind; the pid keeps two separate jobs' rank 0s apart."""
    record = {"node": int(os.environ["HF_LONGCTX_TEST_NODE"]), "pid": os.getpid(), **record}
    path = os.path.join(folder, f"{kind}_{os.getpid()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)  # the test polls the folder: never a half-written file


def record_start(folder: str) -> None:
    """The rank and world size this process's launcher gave it."""
    _write(folder, "start", {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"])})


def record_groups(folder: str) -> None:
    """Wrap the Trainer's first-step check so that, once it passed, the rank writes its SP and DP groups."""
    import torch.distributed as dist

    from hf_longctx.integrations.trainer import patches

    check = patches.verify_first_step

    def verify_and_record(trainer, state, model, inputs) -> None:
        check(trainer, state, model, inputs)
        groups, rank = state.groups, dist.get_rank()
        sp = dist.get_process_group_ranks(groups.sp_group) if groups.sp_group is not None else [rank]
        dp = dist.get_process_group_ranks(groups.dp_group) if groups.dp_group is not None else [rank]
        _write(folder, "groups", {"rank": rank, "world": dist.get_world_size(), "sp": sp, "dp": dp})

    patches.verify_first_step = verify_and_record

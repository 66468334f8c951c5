"""A torchrun job for `test_faults.py`: SP=2 Trainer run whose rank 1 is SIGKILLed in the forward of step 3.

Every rank first writes its process id to `<out>/pid-rank<r>`, so the test can check that none survives.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.dist._fault_jobs import train_job  # noqa: E402

if __name__ == "__main__":
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"pid-rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    train_job(rank, world, out, sp=2, fault={"rank": 1, "step": 3, "phase": "forward"})

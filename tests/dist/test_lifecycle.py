"""Clean shutdown under torchrun: no rank aborts at exit, and the process groups SP creates are destroyed.

Neither Trainer nor accelerate destroys process groups; a gloo group alive at interpreter exit can abort
the process ("terminate called without an active exception", SIGABRT, about one run in three after
`evaluate()` before the fix). The job runs train, evaluate, predict and detach, then a second Trainer that
is garbage collected; every rank must exit 0 with torch.distributed shut down, and the group count must
return to its baseline after detach and after collection.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("_lifecycle_job.py")
ROOT = JOB.parents[2]


def test_train_eval_predict_detach_exit_cleanly(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(JOB)]
    proc = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "terminate called" not in log
    # Two ranks share the pipe, so their lines may interleave: match the records, not whole lines.
    exits = sorted(re.findall(r"EXIT rank=\d+ distributed_shut_down=(?:True|False)", proc.stdout))
    assert exits == [f"EXIT rank={r} distributed_shut_down=True" for r in (0, 1)], log[-4000:]
    results = [json.loads(m) for m in re.findall(r"RESULT (\{[^}]*\})", proc.stdout)]
    assert len(results) == 2, log[-4000:]
    for counts in results:
        # Each attach adds this rank's SP group and DP group; detach and garbage collection remove them.
        assert counts["attached"] == counts["second"] == counts["detached"] + 2, counts
        assert counts["collected"] == counts["detached"], counts

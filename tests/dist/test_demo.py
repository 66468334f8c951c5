"""The custom-loop demo (the README's library example) runs under torchrun and matches SP=1."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_sp2_matches_single_device():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "hf_longctx.cli.demo",
        "--steps",
        "2",
        "--seq-len",
        "256",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    match = re.search(r"max relative loss difference ([0-9.e+-]+) over 2 steps", done.stdout)
    assert match, done.stdout[-2000:]
    assert float(match.group(1)) <= 1e-5

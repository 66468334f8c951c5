"""recipes/reward.py with its CPU YAML: SP=2 under torchrun against the same recipe in one process without SP."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = ["recipes/reward.py", "--config", "recipes/tiny_reward_cpu.yaml"]
LINE = re.compile(r"reward recipe: (\d+) steps, sp=(\d+), losses=(\[[^\]]*\])")  # the ranks' lines may interleave
RTOL = 1e-5


def _run(launcher: list[str], *overrides: str) -> list[tuple[int, int, list[float]]]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    done = subprocess.run([*launcher, *RECIPE, *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    found = [(int(s), int(p), ast.literal_eval(ls)) for s, p, ls in LINE.findall(done.stdout)]
    assert found, done.stdout[-2000:]
    return found


@pytest.mark.slow
def test_reward_recipe_sp2_matches_no_sp(tmp_path):
    ((steps, sp, reference),) = _run([sys.executable], "--sp_size", "1", "--output_dir", str(tmp_path / "a"))
    assert (steps, sp) == (3, 1) and len(reference) == 3
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    ranks = _run(torchrun, "--output_dir", str(tmp_path / "b"))
    assert len(ranks) == 2
    for steps, sp, losses in ranks:
        assert (steps, sp) == (3, 2)
        for got, want in zip(losses, reference, strict=True):
            assert abs(got - want) <= RTOL * abs(want), (losses, reference)

"""recipes/dpo.py with its CPU YAML: SP=2 under torchrun against the same recipe in one process without SP."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = ["recipes/dpo.py", "--config", "recipes/tiny_dpo_cpu.yaml"]
# The two ranks print at once: their lines may run together.
LINE = re.compile(r"dpo recipe: (\d+) steps, sp=(\d+), attention=(\S+), losses=(\[[^\]]*\])")
RTOL = 1e-5


def _run(launcher: list[str], *overrides: str) -> list[tuple[int, int, str, list[float]]]:
    """Every rank's summary line: steps, SP degree, attention implementation, per-step losses."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    done = subprocess.run(
        [*launcher, *RECIPE, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = [(int(s), int(p), a, ast.literal_eval(ls)) for s, p, a, ls in LINE.findall(done.stdout)]
    assert found, done.stdout[-2000:]
    return found


@pytest.mark.slow
def test_dpo_recipe_sp2_matches_no_sp(tmp_path):
    ((steps, sp, attention, reference),) = _run([sys.executable], "--sp_size", "1", "--output_dir", str(tmp_path / "a"))
    assert (steps, sp, attention) == (3, 1, "sdpa")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    ranks = _run(torchrun, "--output_dir", str(tmp_path / "b"))
    assert len(ranks) == 2
    for steps, sp, attention, losses in ranks:
        assert (steps, sp) == (3, 2) and attention.startswith("hf_longctx_ulysses"), (steps, sp, attention)
        assert len(losses) == len(reference) == 3
        for got, want in zip(losses, reference, strict=True):
            assert abs(got - want) <= RTOL * abs(want), (losses, reference)

"""A short version of `benchmarks/drift.py` (300 steps, results in benchmarks/results/*-drift.md).

60 optimizer steps of the tests' tiny llama at SP=2 through the stock Trainer, 12 rows of 32 tokens (five
epochs: every epoch starts a fresh sampler pass and loader iterator), sampled by the benchmark's own probe:
after a 20-step warm-up resident memory grows by at most 1%, the number of threads does not change and
the number of process groups never does.
"""

from __future__ import annotations

import statistics

from benchmarks import drift
from tests import _faults

STEPS, WARMUP = 60, 20


def drift_worker(rank: int, world_size: int, out_dir: str) -> list[dict]:
    import datasets
    import torch

    from tests._models import tiny_model

    gen = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 128, (32,), generator=gen).tolist()} for _ in range(12)]
    return drift.train(out_dir, tiny_model("llama"), datasets.Dataset.from_list(rows), steps=STEPS, sp=world_size)


def test_short_run_does_not_drift(tmp_path, record_property):
    outcomes = _faults.launch(drift_worker, 2, str(tmp_path), timeout=180)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    per_rank = [o.result for o in outcomes]
    assert [len(samples) for samples in per_rank] == [STEPS, STEPS]

    summary = drift.summarize(per_rank, WARMUP)
    for rank in summary["ranks"]:
        assert rank["rss_growth"] <= drift.RSS_GROWTH_LIMIT, rank
        assert len(rank["threads"]) == 1, rank
        # The default group plus this rank's SP and DP groups, from the first step to the last.
        assert rank["groups"] == [3], rank
        # Noise on a shared machine, but not a trend: the second half is not much slower than the first.
        assert rank["step_time_ratio"] < 1.5, rank
    record_property("summary", summary["ranks"])
    record_property("median_step_s", statistics.median(s["step_s"] for s in per_rank[0]))

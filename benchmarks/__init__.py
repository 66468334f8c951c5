"""Benchmarks of hf_longctx, one `python -m benchmarks.<name>` each (benchmarks/README.md); they share `_harness`
(jobs, options, aggregation), `worker` (the training run), `_measure` (what a rank records) and `_results`."""

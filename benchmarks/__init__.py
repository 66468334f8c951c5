"""A/B benchmark of hf_longctx Ulysses SP against the upstream accelerate/DeepSpeed SP path.

`python -m benchmarks.run` is the entry point; `benchmarks.worker` is one measured run (launched by
`torchrun`), `benchmarks.report` holds the pure aggregation, theory and rendering functions.
"""

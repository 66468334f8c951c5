"""The MoE router loss's memory: per-rank peak with the loss on against the same step with it off, CPU.

    python -m benchmarks.router_memory                          # 64K tokens per rank, 1 repeat (~6 min here)
    python -m benchmarks.router_memory --checkpointing          # the same with gradient checkpointing (~8 min)
    python -m benchmarks.router_memory --seq-lens 16384 --out /tmp/router   # a quick look

A Qwen3-MoE shape with 64 experts (top-2) and 8 layers, hidden 128, one process (`sp_size=1`: the per-rank picture
is the same at any SP size, the shard being the rank's tokens), rows of packed 2K-token documents, the stock
`Trainer`, SGD, with or without gradient checkpointing (`--checkpointing`). Variants:

- "loss off": `output_router_logits=False` (hf_longctx attention, as the other two);
- "loss on, layer by layer": hf_longctx (`hf_longctx.sequence.router_loss`: per-expert statistics accumulated by
  hooks on the routers, nothing of size tokens x experts kept beyond what the loss's gradient needs);
- "loss on, transformers": transformers' own router loss (every layer's router logits kept to the loss): the same
  hf_longctx attention with its router-loss hooks left out (`transformers_router_loss` in the worker's spec).

Target (issue 39): "loss on, layer by layer" within 1.05x of "loss off". Writes
`benchmarks/results/<date>-router-memory[-checkpointing].{json,md}`; method: benchmarks/README.md.
"""

from __future__ import annotations

import sys
from typing import Any

from benchmarks import _harness, _results

TARGET = 1.05
EXPERTS, LAYERS, DOC = 64, 8, 2048
MODEL = {"arch": "qwen3_moe", "vocab": 1024, "hidden": 128, "intermediate": 256, "layers": LAYERS, "heads": 4,
         "kv_heads": 2, "head_dim": 32}  # fmt: skip
MOE = {"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "router_aux_loss_coef": 0.01}
# (router loss on, transformers' own router loss); hf_longctx at sp_size=1 comes with an explicit backend.
VARIANTS = {"loss off": (False, False), "loss on, layer by layer": (True, False), "loss on, transformers": (True, True)}


def spec(variant: str, seq_len: int, steps: int, checkpointing: bool = False) -> dict[str, Any]:
    on, theirs = VARIANTS[variant]
    model = {**MODEL, "max_positions": seq_len, "extra": {**MOE, "output_router_logits": on}}
    return {"impl": "hf_longctx", "sp": 1, "sp_options": {"sp_backend": "ulysses"}, "transformers_router_loss": theirs,
            "engine": "ddp", "trainer": "trainer", "data": "packed", "doc_len": DOC, "seq_len": seq_len, "warmup": 1,
            "steps": 1 + steps, "optim": "sgd", "lr": 1e-3, "log": True, "threads": 1, "dtype": "fp32",
            "attn": "sdpa", "model": model, "gradient_checkpointing": checkpointing}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = _harness.options(__doc__, "router-memory", timeout=1800, repeats=1, steps=1)
    parser.add_argument("--seq-lens", default="65536")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on in every run")
    args = parser.parse_args(argv)
    if args.checkpointing and not args.out:
        args.out = f"{_harness.out(args)}-checkpointing"

    def launch(seq_len: int, variant: str) -> dict[str, Any]:
        job = spec(variant, seq_len, args.steps, args.checkpointing)
        return {"target": "benchmarks.worker:run", "nproc": 1, "env": _harness.CPU_ENV, "spec": job}

    def numbers(record: dict[str, Any]) -> dict[str, Any]:
        step_s = _harness.slowest_rank_median(record["result"]["ranks"], "step_s", 1)
        return {"peak": _harness.worst(record, "run_peak_bytes"), "step_s": step_s}

    columns: list[_results.Column] = [
        _results.col("peak GiB", "peak", ".3f", _results.GiB), _results.col("x loss off", "x_peak", ".3f"),
        ("target", lambda r: _results.target(r["x_peak"], TARGET) if r["variant"] == "loss on, layer by layer" else ""),
        _results.col("step s", "step_s"), _results.col("x loss off", "x_step_s", ".3f"),
    ]  # fmt: skip
    return _harness.compare(
        args, argv, [int(s) for s in args.seq_lens.split(",")], list(VARIANTS), launch, numbers, columns,
        f"MoE router loss memory, one rank: {EXPERTS} experts, {LAYERS} layers, CPU"
        + (", gradient checkpointing" if args.checkpointing else ""),
        "Model and method: the module docstring of benchmarks/router_memory.py and benchmarks/README.md.",
        target=("loss on, layer by layer", "x_peak", TARGET),
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

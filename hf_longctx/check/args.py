"""`hf-longctx check`'s options, torch-free: `hf-longctx --help` and `plan` must not import torch.

`add_arguments` is used by `hf_longctx.cli.main` and `python -m hf_longctx.check`; the check itself is
`command.run`.
"""

from __future__ import annotations

import argparse

# Self-test faults of the checker. "skip-positions": workers feed shard-local position ids
# (0..S/K-1 on every rank) instead of the global ones, which breaks RoPE and the causal mask.
FAULTS = ("skip-positions",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `check` options to `parser`."""
    parser.add_argument("--model", required=True, help="local folder with config.json, or a config.json file")
    parser.add_argument("--sp", type=int, required=True, help="sequence-parallel size K (K torchrun ranks)")
    parser.add_argument(
        "--seq-len", type=int, default=67, help="tokens per row; odd lengths exercise padding (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=1, help="rows in the batch (default: %(default)s)")
    parser.add_argument(
        "--layers", type=int, default=2, help="num_hidden_layers of the test copy (default: %(default)s)"
    )
    parser.add_argument(
        "--hidden", type=int, default=0, help="shrink hidden size to this (heads kept; 0 keeps the original)"
    )
    parser.add_argument(
        "--attn", choices=("sdpa", "eager"), default="sdpa", help="attention kernel (default: %(default)s)"
    )
    parser.add_argument("--packed", action="store_true", help="pack 3 documents per row (restarting positions)")
    parser.add_argument(
        "--backend",
        choices=("ulysses", "ring", "hybrid", "auto"),
        default="ulysses",
        help="SP backend under test (default: %(default)s)",
    )
    parser.add_argument(
        "--ulysses-degree", type=int, default=None, help="hybrid/auto: Ulysses degree (default: chosen)"
    )
    parser.add_argument(
        "--ring-variant",
        choices=("p2p", "allgather"),
        default=None,
        help="ring/hybrid variant (default: p2p; auto chooses)",
    )
    parser.add_argument(
        "--tolerance-loss", type=float, default=1e-5, help="max relative loss difference (default: %(default)s)"
    )
    parser.add_argument(
        "--tolerance-grad", type=float, default=1e-4, help="max relative gradient difference (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before the SP run is killed (default: %(default)s)"
    )
    parser.add_argument(
        "--inject-fault",
        choices=FAULTS,
        default=None,
        help="self-test of the checker: break the SP run on purpose (skip-positions: shard-local position ids); "
        "the check must then FAIL",
    )

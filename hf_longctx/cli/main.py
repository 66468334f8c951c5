"""The `hf-longctx` command line: `check` (is SP exact for my model?), `plan` (what fits?) and `demo`.

`main(argv)` only parses and dispatches: `check` lives in `hf_longctx/check/`, `plan` in
`hf_longctx/cli/plan.py`, `demo` hands over to torchrun running `hf_longctx/cli/demo.py`. Parsing
imports no torch (`hf-longctx --help` and `plan` answer at once); `check` imports it when it runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from hf_longctx.check import args as check_args
from hf_longctx.cli import plan as plan_cli


def build_parser() -> argparse.ArgumentParser:
    """The `hf-longctx` parser with one subparser per command."""
    parser = argparse.ArgumentParser(prog="hf-longctx", description="Exact Ulysses sequence parallelism for HF.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check_parser = commands.add_parser(
        "check",
        help="is SP exact for this model? (CPU, small random-init copy, torchrun gloo ranks vs SP=1)",
        description=(
            "Build a small random-init float32 copy of a local config, run one training step at "
            "SP=K in K torchrun gloo ranks and at SP=1 in this process, and compare loss and gradients. "
            "Exit 0 = PASS, 1 = FAIL (not exact, crashed or timed out), 2 = invalid input."
        ),
    )
    check_args.add_arguments(check_parser)
    plan_parser = commands.add_parser(
        "plan",
        help="per-rank peak memory and the longest sequence that fits, before launching (no GPU needed)",
        description=(
            "Model one training step's per-rank peak memory by term for a model config, sequence length, "
            "SP size, engine and memory flags; when it does not fit with the planner's error (15%) as headroom, "
            "print the cheapest configuration that does, as the settings to use. Exit 0 = fits, 3 = tight (fits "
            "with less headroom), 1 = does not fit, 2 = invalid input."
        ),
    )
    plan_cli.add_arguments(plan_parser)
    demo_parser = commands.add_parser(
        "demo",
        help="custom-loop demo: torchrun -m hf_longctx.cli.demo (extra options go to the demo)",
        description=(
            "Run `torchrun --standalone --nproc_per_node N -m hf_longctx.cli.demo [options]`; every option "
            "other than --nproc goes to the demo (see `python -m hf_longctx.cli.demo --help`)."
        ),
    )
    demo_parser.add_argument("--nproc", type=int, default=2, help="number of ranks (default 2)")
    return parser


def run_demo(nproc: int, demo_args: list[str]) -> int:
    """Launch the demo under torchrun and return its exit code.

    Args:
        nproc: processes (the demo's SP size).
        demo_args: options passed through to `hf_longctx.cli.demo` (e.g. `--steps 3`).

    Returns:
        torchrun's exit code.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.call([*cmd, "-m", "hf_longctx.cli.demo", *demo_args])


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hf-longctx` console script.

    Args:
        argv: the arguments after the program name (default: `sys.argv[1:]`).

    Returns:
        The process exit code of the command.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "demo":
        return run_demo(args.nproc, [a for a in extra if a != "--"])
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "plan":
        return plan_cli.run(args)
    from hf_longctx.check.command import run as run_check  # torch: only when a check runs

    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())

"""`python -m hf_longctx.check`: the torchrun worker (`--worker SPEC`) or the check itself."""

from __future__ import annotations

import argparse
import sys

from hf_longctx.check.command import add_arguments, run
from hf_longctx.check.worker import worker_main


def main(argv: list[str] | None = None) -> int:
    """The torchrun worker (`--worker SPEC`) or the check itself."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--worker":
        from torch.distributed.elastic.multiprocessing.errors import record

        record(worker_main)(argv[1])  # a worker's traceback then heads torchrun's failure summary
        return 0
    parser = argparse.ArgumentParser(prog="python -m hf_longctx.check", description=run.__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`hf-longctx check`: is sequence parallelism exact for this model architecture?

`run(args)` (`command.py`) is the entry: it builds a small random-init float32 copy of a local config
(`model.py`), runs one SP=K training step in K gloo ranks launched by torchrun (`worker.py`; their
entry is `python -m hf_longctx.check --worker SPEC`), recomputes the step at SP=1 in this process
with the plain model and compares the loss and every gradient (`report.py`).
"""

from hf_longctx.check.command import EXIT_FAIL, EXIT_INVALID, EXIT_PASS, add_arguments, run
from hf_longctx.check.model import MAX_VOCAB, make_batch, reference_step, shrink_config
from hf_longctx.check.report import compare, verdict

__all__ = [
    "EXIT_FAIL",
    "EXIT_INVALID",
    "EXIT_PASS",
    "MAX_VOCAB",
    "add_arguments",
    "compare",
    "make_batch",
    "reference_step",
    "run",
    "shrink_config",
    "verdict",
]

"""`hf-longctx check`: is sequence parallelism exact for this model architecture?

`run(args)` (`command.py`) is the entry: it builds a small random-init float32 copy of a local config
(`model.py`), runs one SP=K training step in K gloo ranks launched by torchrun (`worker.py`; their
entry is `python -m hf_longctx.check --worker SPEC`), recomputes the step at SP=1 in this process
with the plain model and compares the loss and every gradient (`report.py`). The options
(`args.py`) import no torch, and neither does this package until a name is used.
"""

from hf_longctx._lazy import lazy_exports

_EXPORTS = {
    "EXIT_FAIL": "hf_longctx.check.command",
    "EXIT_INVALID": "hf_longctx.check.command",
    "EXIT_PASS": "hf_longctx.check.command",
    "MAX_VOCAB": "hf_longctx.check.model",
    "add_arguments": "hf_longctx.check.args",
    "compare": "hf_longctx.check.report",
    "make_batch": "hf_longctx.check.model",
    "reference_step": "hf_longctx.check.model",
    "run": "hf_longctx.check.command",
    "shrink_config": "hf_longctx.check.model",
    "verdict": "hf_longctx.check.report",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

"""Zero-code hook-up of hf_longctx SP into `transformers.Trainer` / TRL `SFTTrainer`.

accelerate calls `ParallelismConfig._validate_accelerator(accelerator)` inside `Accelerator.__init__`;
for our backends that calls `attach` (`accelerator.py`), which changes that accelerator only: models
get SP attention when prepared, data loaders are sampled by DP rank and sharded per SP rank
(`dataloader.py`), metrics are merged over the SP group (`metrics.py`, `evaluation.py`). A few
class-level Trainer methods are patched (`patches.py`), acting only for attached accelerators.
`detach(trainer)` undoes all of it and destroys the process groups SP created.
"""

from hf_longctx._lazy import lazy_exports

_EXPORTS = {
    "SequenceParallelState": "hf_longctx.integrations.trainer.state",
    "UniversalCheckpointFix": "hf_longctx.integrations.trainer.resume",
    "attach": "hf_longctx.integrations.trainer.accelerator",
    "detach": "hf_longctx.integrations.trainer.accelerator",
    "install_trainer_patches": "hf_longctx.integrations.trainer.patches",
    "remove_trainer_patches": "hf_longctx.integrations.trainer.patches",
    "sp_hidden": "hf_longctx.integrations.trainer.state",
    "sp_state": "hf_longctx.integrations.trainer.state",
    "takes_shifted_labels": "hf_longctx.integrations.trainer.patches",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

"""Zero-code hook-up of hf_longctx SP into `transformers.Trainer` / TRL `SFTTrainer`.

accelerate calls `ParallelismConfig._validate_accelerator(accelerator)` inside `Accelerator.__init__`;
for our backends that calls `attach` (`accelerator.py`), which changes that accelerator only: models
get SP attention when prepared, data loaders are sampled by DP rank and sharded per SP rank
(`dataloader.py`), metrics are merged over the SP group (`metrics.py`, `evaluation.py`). A few
class-level Trainer methods are patched (`patches.py`), acting only for attached accelerators.
`detach(trainer)` undoes all of it and destroys the process groups SP created.
"""

from hf_longctx.integrations.trainer.accelerator import attach, detach, sp_hidden
from hf_longctx.integrations.trainer.patches import (
    install_trainer_patches,
    remove_trainer_patches,
    takes_shifted_labels,
)
from hf_longctx.integrations.trainer.resume import UniversalCheckpointFix
from hf_longctx.integrations.trainer.state import SequenceParallelState, sp_state

__all__ = [
    "SequenceParallelState",
    "UniversalCheckpointFix",
    "attach",
    "detach",
    "install_trainer_patches",
    "remove_trainer_patches",
    "sp_hidden",
    "sp_state",
    "takes_shifted_labels",
]

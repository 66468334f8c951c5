"""Public entry of the Trainer / TRL integration: `detach(trainer)` and the class-patch switches.

The integration itself lives in `hf_longctx.integrations.trainer`; these names are the ones user code
calls (`hf_longctx.trainer.detach(trainer)` before using a trained model in one process).
"""

from hf_longctx.integrations.trainer.accelerator import attach, detach
from hf_longctx.integrations.trainer.patches import install_trainer_patches, remove_trainer_patches
from hf_longctx.integrations.trainer.resume import UniversalCheckpointFix
from hf_longctx.integrations.trainer.state import sp_state

__all__ = [
    "UniversalCheckpointFix",
    "attach",
    "detach",
    "install_trainer_patches",
    "remove_trainer_patches",
    "sp_state",
]

"""hf_longctx: exact sequence parallelism for Hugging Face Trainer / TRL.

Importing this package changes nothing; `enable_sequence_parallel` (or the Trainer integration
through `ParallelismConfig`) is what switches a model to sequence-parallel attention.
"""

from .attention.registry import SequenceParallelHandle, enable_sequence_parallel
from .config import ParallelismConfig
from .data.consistency import shard_batch
from .data.sharding import IGNORE_INDEX
from .groups import SequenceParallelGroups
from .loss import sequence_parallel_loss
from .trainer.patches import takes_shifted_labels

__all__ = [
    "IGNORE_INDEX",
    "ParallelismConfig",
    "SequenceParallelGroups",
    "SequenceParallelHandle",
    "enable_sequence_parallel",
    "sequence_parallel_loss",
    "shard_batch",
    "takes_shifted_labels",
]
__version__ = "0.1.0"

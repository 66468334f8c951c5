"""hf_longctx: exact sequence parallelism for Hugging Face Trainer / TRL.

Importing this package changes nothing and imports no torch: every public name below is resolved on
first use. `enable_sequence_parallel` (or the Trainer integration through `ParallelismConfig`) is
what switches a model to sequence-parallel attention.
"""

from hf_longctx._lazy import lazy_exports

_EXPORTS = {
    "IGNORE_INDEX": "hf_longctx.data.sharding",
    "ParallelismConfig": "hf_longctx.config",
    "SequenceParallelGroups": "hf_longctx.distributed.groups",
    "SequenceParallelHandle": "hf_longctx.attention.registry",
    "enable_sequence_parallel": "hf_longctx.attention.registry",
    "sequence_parallel_loss": "hf_longctx.loss",
    "shard_batch": "hf_longctx.data.consistency",
    "takes_shifted_labels": "hf_longctx.integrations.trainer.patches",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

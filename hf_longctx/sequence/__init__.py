"""What a model computes over the whole sequence outside attention, exact under SP (`SequenceOps`).

Under SP each rank runs the model on its shard; attention and the token loss see the whole sequence through
hf_longctx, and so must everything else that reads it: the MoE router load-balancing loss, run-time RoPE
(dynamic NTK, longrope), Llama 4's query temperature, NEFTune's noise scale, the losses of token-classification and
extractive-QA heads, and AdaLoRA's regulariser (counted once per SP group).
"""

from hf_longctx.sequence.heads import label_kind
from hf_longctx.sequence.ops import SequenceOps
from hf_longctx.sequence.replicated import is_replicated, mark_replicated
from hf_longctx.sequence.view import ShardView

__all__ = ["SequenceOps", "ShardView", "is_replicated", "label_kind", "mark_replicated"]

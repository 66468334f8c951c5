"""`SequenceOps`: what one SP-enabled model computes over the whole sequence outside attention, kept exact.

The SP handle (`attention/registry.py`) creates one per model and calls `begin` from its forward pre-hook (with
the forward's `ShardView`) and `finish` from a forward hook. It owns the router loss (`router_loss.py`), the
run-time RoPE patches (`rope.py`), the loss of token-classification and QA heads (`head_losses.py`) and the NEFTune
hook the Trainer integration installs (`neftune.py`); Llama 4's
query temperature is applied by the attention function itself (`temperature.py`). What else a model computes over
the sequence, and which of it is exact as is, is listed in docs/sequence-ops.md.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_longctx.distributed.groups import SequenceParallelGroups
from hf_longctx.sequence.adapter_terms import AdapterTerms
from hf_longctx.sequence.head_losses import QuestionAnsweringLoss, TokenClassificationLoss
from hf_longctx.sequence.heads import QUESTION_ANSWERING, TOKEN_CLASSIFICATION, head_of
from hf_longctx.sequence.neftune import neftune_hook
from hf_longctx.sequence.peft_positions import keep_position_ids
from hf_longctx.sequence.rope import patch_runtime_rope
from hf_longctx.sequence.router_loss import RouterLoss
from hf_longctx.sequence.router_source import FLAG, router_modules
from hf_longctx.sequence.view import ShardView


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    # A PEFT model runs the transformers model it wraps with the same keyword arguments.
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def token_weights(kwargs: dict[str, Any], view: ShardView) -> torch.Tensor:
    """`[bs * sl_l]` 1.0 for every token of the shard a run without SP counts, 0.0 for padding (the attention mask
    where one is given, as transformers' router loss reads it, and always the SP padding)."""
    ids = kwargs.get("input_ids")
    ids = kwargs.get("inputs_embeds") if ids is None else ids
    bs, sl = ids.shape[0], ids.shape[1]
    weights = view.real_tokens().to(ids.device, torch.float32).expand(bs, sl)
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) == (bs, sl):
        weights = weights * mask.to(weights)
    return weights.reshape(-1)


_HEAD_LOSSES = {TOKEN_CLASSIFICATION: TokenClassificationLoss, QUESTION_ANSWERING: QuestionAnsweringLoss}


class SequenceOps:
    """Installed on one model with its SP handle, removed with it (`remove`)."""

    def __init__(self, model: torch.nn.Module, groups: SequenceParallelGroups) -> None:
        self.groups = groups
        self.view: ShardView | None = None  # the forward in progress
        self.neftune = False  # a NEFTune hook reads the view
        base = _transformers_model(model)
        self.router = RouterLoss.attach(base)
        # Router logits recorded by a family whose forward adds no router loss (Llama 4, DeepSeek-V3, ...).
        self.loss_free_routers = self.router is None and groups.sp_enabled and bool(router_modules(base))
        # Also with one rank: a packed row must give each document its own frequencies.
        self.rope = patch_runtime_rope(base, lambda: self.view)
        # With one rank the head sees its whole row already.
        head_loss = _HEAD_LOSSES.get(head_of(base)[0]) if groups.sp_enabled else None
        # AdaLoRA's regulariser: shared over the group, or added to the loss of a head computed here.
        self.adapters = AdapterTerms.attach(model, groups, shared=head_loss is None)
        term = self.adapters.add_to if self.adapters is not None and head_loss is not None else None
        self.head = None if head_loss is None else head_loss(groups, term)
        self.undo_positions = keep_position_ids(model)  # PEFT's QA wrapper drops them

    @property
    def needs_view(self) -> bool:
        """Whether anything installed reads the forward's view (else the pre-hook builds none: under
        `torch.compile` reading the row length is a graph break)."""
        return (
            self.router is not None
            or self.loss_free_routers
            or bool(self.rope)
            or self.neftune
            or self.head is not None
            or self.adapters is not None
        )

    def begin(self, kwargs: dict[str, Any], view: ShardView) -> None:
        """At a forward's start (after the SP input checks): record its view, take over what needs it."""
        self.view = view
        if self.head is not None:
            self.head.begin(kwargs, view)
        if self.adapters is not None:
            self.adapters.begin()
        if self.router is not None:
            self.router.begin(kwargs, token_weights(kwargs, view))
        elif self.loss_free_routers and kwargs.get("fused_lm_head") and kwargs.get(FLAG):
            # TRL's fused LM head then adds Mixtral's router loss itself, from this shard's router logits only.
            raise ValueError(
                "TRL adds a router load-balancing loss to this model (router_aux_loss_coef != 0), which its own "
                "forward does not compute; under sequence parallelism TRL would compute it from each rank's shard "
                "(a wrong loss). Set router_aux_loss_coef=0.0 in the trainer's config, or train with sp_size=1."
            )

    def finish(self, output: Any) -> Any:
        """At a forward's end (also after an exception: `output` None). Returns the output to use instead of the
        model's (its head's loss taken over the whole row), or None to keep it."""
        self.view = None
        self.rope.end_forward()
        if self.adapters is not None:
            self.adapters.finish()
        replaced = None if self.head is None else self.head.finish(output)
        if self.router is not None:
            if output is None:
                self.router.abort()
            else:
                self.router.finish(output if replaced is None else replaced, self.groups)
        return replaced

    def neftune_hook(self) -> Any:
        """A NEFTune forward hook for the input embeddings that scales by the whole row's length."""
        self.neftune = True
        return neftune_hook(lambda: self.view)

    def remove(self) -> None:
        if self.router is not None:
            self.router.remove()
        self.rope.remove()
        for undo in self.undo_positions:
            undo()

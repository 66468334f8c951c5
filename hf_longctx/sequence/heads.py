"""Which head a model puts on its decoder, and so what its labels mean and how its loss reads the sequence.

Under SP each rank holds a slice of every row, so the head decides what must happen around it:

- causal LM / conditional generation (VLMs): labels are the next token, shifted on the full row before sharding
  (`data/sharding.py`), and the loss is a token mean the Trainer integration weights over the SP group;
- token classification: every token keeps its *own* label (`LayoutSlot.labels == "per_token"`), and the loss is
  normalised over the SP group's labelled tokens (`head_losses.TokenClassificationLoss`);
- extractive question answering: start / end are a softmax over the token positions of the whole row, with global
  answer indices (`head_losses.QuestionAnsweringLoss`);
- sequence classification: the score is pooled at the row's last real token, which one rank holds
  (RewardTrainer's SP path fetches it, `integrations/trl/reward.py`).

Any other head is unknown to hf_longctx, and the Trainer integration refuses it by class name under SP
(`integrations/trl/support.py`): a loss hf_longctx has not checked could read the shard as if it were the row.
The head is read from the model class: transformers' own auto-class registries first (the class names each
`AutoModelFor...` maps to), then the name's suffix (remote-code classes follow the same naming).
"""

from __future__ import annotations

import functools
from typing import Any

CAUSAL_LM = "causal language modeling"
CONDITIONAL_GENERATION = "conditional generation"
SEQUENCE_CLASSIFICATION = "sequence classification"
TOKEN_CLASSIFICATION = "token classification"
QUESTION_ANSWERING = "extractive question answering"
KNOWN = (CAUSAL_LM, CONDITIONAL_GENERATION, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, QUESTION_ANSWERING)

# transformers' auto-class registries (`transformers.models.auto.modeling_auto`), in order of precedence.
_REGISTRIES = (
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", TOKEN_CLASSIFICATION),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", QUESTION_ANSWERING),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", SEQUENCE_CLASSIFICATION),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", CAUSAL_LM),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", CONDITIONAL_GENERATION),
    ("MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", CONDITIONAL_GENERATION),
)
_SUFFIXES = (
    ("ForTokenClassification", TOKEN_CLASSIFICATION),
    ("ForQuestionAnswering", QUESTION_ANSWERING),
    ("ForSequenceClassification", SEQUENCE_CLASSIFICATION),
    ("ForCausalLM", CAUSAL_LM),
    ("LMHeadModel", CAUSAL_LM),
    ("ForConditionalGeneration", CONDITIONAL_GENERATION),
)


@functools.cache
def _registered() -> dict[str, str]:
    from transformers.models.auto import modeling_auto

    kinds: dict[str, str] = {}
    for name, kind in _REGISTRIES:
        for value in getattr(modeling_auto, name, {}).values():
            for cls_name in value if isinstance(value, (tuple, list)) else (value,):
                kinds.setdefault(cls_name, kind)
    return kinds


def kind_of_class_name(name: str) -> str | None:
    """The head a model class of this name carries (None: not one hf_longctx knows)."""
    kind = _registered().get(name)
    if kind is not None:
        return kind
    return next((kind for suffix, kind in _SUFFIXES if name.endswith(suffix)), None)


def head_of(model: Any) -> tuple[str | None, str]:
    """`(head kind or None, the class name it was read from)` for a model, PEFT-wrapped or not.

    The most derived class whose name names a head decides, so a user's subclass of `LlamaForCausalLM` is a
    causal LM; a model with no such class in its MRO (a bare `LlamaModel`, a custom wrapper) is `None`, named by
    its own class.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cls in type(base).__mro__:
        kind = kind_of_class_name(cls.__name__)
        if kind is not None:
            return kind, cls.__name__
    return None, type(base).__name__


def label_kind(model: Any) -> str:
    """What `labels` mean for `model`'s head: "per_token" (token classification) or "next_token" (the rest)."""
    return "per_token" if head_of(model)[0] == TOKEN_CLASSIFICATION else "next_token"

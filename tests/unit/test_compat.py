"""Pins the transformers behaviours hf_longctx relies on, so that an upgrade that changes one fails here."""

from __future__ import annotations

import pytest
import torch
import transformers.models.llama.modeling_llama as modeling_llama
import transformers.models.qwen3.modeling_qwen3 as modeling_qwen3
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    create_causal_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from hf_longctx import _compat
from tests._models import tiny_config, tiny_model

KEY = "hf_longctx_test_compat"


def _fn(*args, **kwargs):
    raise AssertionError("never called")


@pytest.mark.parametrize(
    ("registry", "cls"),
    [(ALL_ATTENTION_FUNCTIONS, AttentionInterface), (ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface)],
)
def test_setitem_and_del_touch_only_the_instance(registry, cls):
    global_before = dict(cls._global_mapping)
    keys_before = list(registry.keys())
    registry[KEY] = _fn
    try:
        assert registry[KEY] is _fn
        assert KEY in registry
        assert KEY not in cls._global_mapping
        assert KEY not in cls()  # a fresh instance sees only the class-global mapping
        assert cls._global_mapping == global_before
    finally:
        del registry[KEY]
    assert KEY not in registry
    assert list(registry.keys()) == keys_before
    assert cls._global_mapping == global_before


def test_attention_registries_are_the_singletons():
    assert _compat.attention_registries() == (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS)
    attn, mask = _compat.attention_registries()
    assert attn is ALL_ATTENTION_FUNCTIONS and mask is ALL_MASK_ATTENTION_FUNCTIONS


def test_create_causal_mask_builds_none_for_a_key_outside_the_global_mask_mapping():
    config = tiny_config("llama")
    embeds = torch.zeros(2, 5, config.hidden_size)
    mask_2d = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    packed = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    ALL_ATTENTION_FUNCTIONS[KEY] = sdpa_attention_forward
    ALL_MASK_ATTENTION_FUNCTIONS[KEY] = _fn  # locally registered keys are ignored by the mask factory
    try:
        config._attn_implementation = KEY
        for attention_mask, position_ids in ((mask_2d, None), (None, packed), (mask_2d, packed)):
            mask = create_causal_mask(
                config=config,
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                cache=None,
                position_ids=position_ids,
            )
            assert mask is None
        # Control: with the stock key transformers does build a (packed) mask.
        config._attn_implementation = "eager"
        mask = create_causal_mask(
            config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=packed
        )
        assert isinstance(mask, torch.Tensor) and mask.shape == (2, 1, 5, 5)
    finally:
        del ALL_ATTENTION_FUNCTIONS[KEY]
        del ALL_MASK_ATTENTION_FUNCTIONS[KEY]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_model_forward_passes_no_mask_to_a_locally_registered_key(arch):
    model = tiny_model(arch, layers=2).eval()
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append((module, attention_mask, kwargs))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS[KEY] = recording
    ALL_MASK_ATTENTION_FUNCTIONS[KEY] = _fn
    config = model.config
    try:
        config._attn_implementation = KEY
        # Every attention module reads this same config object (the registry sets it once).
        assert all(m.config is config for m in model.modules() if hasattr(m, "num_key_value_groups"))
        ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 0, 0]])
        position_ids = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
        with torch.no_grad():
            model(
                input_ids=ids,
                attention_mask=torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]]),
                position_ids=position_ids,
            )
    finally:
        config._attn_implementation = "sdpa"
        del ALL_ATTENTION_FUNCTIONS[KEY]
        del ALL_MASK_ATTENTION_FUNCTIONS[KEY]
    assert len(calls) == 2
    for module, attention_mask, kwargs in calls:
        assert attention_mask is None
        assert hasattr(module, "num_key_value_groups")  # the attention module itself is passed
        assert "scaling" in kwargs and "dropout" in kwargs  # eager kernels need `scaling`


def test_resolve_kernel():
    llama_attention = tiny_model("llama", layers=1).model.layers[0].self_attn
    qwen3_attention = tiny_model("qwen3", layers=1).model.layers[0].self_attn
    assert _compat.resolve_kernel("eager", llama_attention) is modeling_llama.eager_attention_forward
    assert _compat.resolve_kernel("eager", qwen3_attention) is modeling_qwen3.eager_attention_forward
    assert _compat.resolve_kernel("sdpa", llama_attention) is sdpa_attention_forward
    assert _compat.resolve_kernel("flex_attention", llama_attention) is ALL_ATTENTION_FUNCTIONS["flex_attention"]
    with pytest.raises(ValueError, match="not registered"):
        _compat.resolve_kernel("no_such_kernel", llama_attention)
    with pytest.raises(ValueError, match="eager_attention_forward"):
        _compat.resolve_kernel("eager", torch.nn.Linear(2, 2))


def test_check_versions_accepts_installed_transformers():
    _compat.check_versions()
    assert _compat.TRANSFORMERS_VERSION >= _compat.MIN_TRANSFORMERS

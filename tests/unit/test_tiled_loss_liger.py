"""`tiled_loss` chooses its kernel explicitly: hf_longctx's tiles unless `tiled_loss="liger"` was asked for
(an installed liger-kernel is never picked up silently), and asking for Liger without it, or off CUDA,
raises naming the fix."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hf_longctx.memory import apply_memory_flags
from tests._models import tiny_model

LIGER = "liger_kernel.transformers.functional"


@pytest.fixture
def liger_standin(monkeypatch):
    """A stand-in `liger_kernel` whose fused linear cross-entropy records its calls."""
    calls = []

    def liger_fused_linear_cross_entropy(*args, **kwargs):
        calls.append(kwargs)
        raise AssertionError("the stand-in Liger kernel was called")

    module = types.ModuleType(LIGER)
    module.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    for name in ("liger_kernel", "liger_kernel.transformers", LIGER):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _loss(model, flag):
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    with apply_memory_flags(model, SimpleNamespace(tiled_loss=flag)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss


def test_ours_is_used_although_liger_is_installed(liger_standin, caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="hf_longctx.memory.tiled_loss"):
        loss = _loss(model, True)
    assert torch.isfinite(loss) and not liger_standin
    assert "hf_longctx tiles of" in caplog.text


def test_liger_asked_for_off_cuda_raises_naming_the_fix(liger_standin, caplog):
    model = tiny_model("llama")
    with caplog.at_level(logging.INFO, logger="hf_longctx.memory.tiled_loss"):
        with pytest.raises(ValueError, match="needs CUDA tensors.*tiled_loss=True"):
            _loss(model, "liger")
    assert "Liger's fused linear cross-entropy" in caplog.text
    assert not liger_standin


def test_liger_asked_for_but_not_installed_raises_naming_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, LIGER, None)  # import fails, as without liger-kernel
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        apply_memory_flags(tiny_model("llama"), SimpleNamespace(tiled_loss="liger"))


def test_liger_refuses_a_logit_scale(liger_standin):
    model = tiny_model("llama")
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="no logit scaling.*tiled_loss=True"):
        apply_memory_flags(model, SimpleNamespace(tiled_loss="liger"))


def test_config_accepts_liger_and_rejects_other_strings():
    from hf_longctx import ParallelismConfig

    assert ParallelismConfig(tiled_loss="liger").tiled_loss == "liger"
    with pytest.raises(ValueError, match="True, False or 'liger'"):
        ParallelismConfig(tiled_loss="fast")

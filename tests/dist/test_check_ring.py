"""`hf-longctx check --backend`: the 9-query / 3-kv-head SmolLM2-135M shape, which Ulysses refuses at SP=2,
passes with `--backend auto` (auto picks the ring); ring-only refusals exit 2 before launching."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config

import hf_longctx.check
from tests.dist.test_check import REPO_ROOT, run_check, write_config

SMOLLM2 = str(REPO_ROOT / "configs" / "models" / "smollm2_135m_shape")


def test_nine_head_model_passes_with_auto_at_sp2(capsys):
    code, out = run_check(capsys, "--model", SMOLLM2, "--sp", "2", "--backend", "auto", "--packed", "--hidden", "144")
    assert code == 0, out
    assert "9 heads / 3 kv heads" in out
    assert "backend: ring (Ulysses degree 1 x ring 2, zigzag layout" in out
    assert out.strip().splitlines()[-1].startswith("PASS: SP=2 matches SP=1 for LlamaForCausalLM"), out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "ulysses"], "valid sp_size values for this model: [1, 3, 9]"),
        (["--backend", "hybrid", "--ulysses-degree", "2"], "valid degrees: [1]"),
    ],
)
def test_invalid_backend_options_exit_2_without_launching(argv, message, capsys, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("nothing may be launched for invalid input")

    monkeypatch.setattr(hf_longctx.check.worker.subprocess, "Popen", no_launch)
    code, out = run_check(capsys, "--model", SMOLLM2, "--sp", "2", *argv)
    assert code == 2 and message in out, out


def test_ring_refuses_soft_capping_before_launching(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(
        hf_longctx.check.worker.subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError)
    )
    config = Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0,
    )  # fmt: skip
    code, out = run_check(
        capsys, "--model", str(write_config(tmp_path, config)), "--sp", "2", "--backend", "ring", "--attn", "eager"
    )
    assert code == 2 and 'sp_backend="ulysses"' in out, out

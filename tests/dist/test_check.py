"""`hf-longctx check` end to end: PASS for tiny Llama and Qwen3 configs at SP=2, clear failures otherwise.

Every PASS/FAIL case launches torchrun with 2 gloo ranks (~15 s on a 2-core machine); invalid input
must be refused before anything is launched. The configs are written to `tmp_path` (config only).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import transformers
from transformers import LlamaConfig, Qwen3Config

import hf_longctx.check
from hf_longctx.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def write_config(tmp_path: Path, config) -> Path:
    """Save only the config (no weights) and return its folder."""
    folder = tmp_path / config.model_type
    config.save_pretrained(folder)
    return folder


def llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=1000,  # > 512: the check caps it
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=999,  # out of the capped range: must be dropped, not crash
    )
    return LlamaConfig(**{**kwargs, **overrides})


def run_check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(["check", *argv, "--timeout", str(TIMEOUT_S)])
    return code, capsys.readouterr().out


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain `text` (Linux /proc; empty elsewhere)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            data = cmdline.read_bytes()
        except OSError:
            continue
        if text.encode() in data:
            found.append(data.replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_llama_sp2_passes(tmp_path, capsys):
    code, out = run_check(capsys, "--model", str(write_config(tmp_path, llama_config())), "--sp", "2")
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("PASS: SP=2 matches SP=1 for LlamaForCausalLM"), out
    assert "vocab 1000 -> 512" in out
    assert "valid labels per SP rank: [0, " in out  # rank 0's shard has no valid label


def test_qwen3_packed_eager_shrunk_sp2_passes(tmp_path, capsys):
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    config_file = write_config(tmp_path, config) / "config.json"
    argv = ["--model", str(config_file), "--sp", "2", "--packed", "--attn", "eager", "--hidden", "64"]
    code, out = run_check(capsys, *argv)
    assert code == 0, out
    assert "hidden 128 -> 64 (head_dim 16)" in out
    assert "packed: 3 docs/row" in out
    assert out.strip().splitlines()[-1].startswith("PASS: SP=2 matches SP=1 for Qwen3ForCausalLM"), out


def vlm_config(model_type: str):
    """A tiny Qwen2.5-VL / Qwen3-VL / LLaVA decoder (the check shrinks the full-size vision tower it carries)."""
    rope = {"mrope_section": [2, 3, 3]}
    rope.update(
        {"type": "mrope"} if model_type == "qwen2_5_vl" else {"rope_type": "default", "mrope_interleaved": True}
    )
    text = {**llama_config(num_hidden_layers=2).to_dict(), "rope_scaling": rope}
    for key in ("model_type", "architectures", "transformers_version", "eos_token_id"):
        text.pop(key, None)
    return transformers.AutoConfig.for_model(model_type, text_config=text)


def sequence_ops_config(kind: str):
    """Configs as shipped with a whole-sequence computation: a Qwen3-MoE (its router loss off, as in its default
    config: the check turns it on), a Llama with dynamic RoPE, a Qwen3-VL-MoE (router loss, DeepStack, mRoPE)."""
    from transformers import Qwen3MoeConfig

    if kind == "qwen3_moe":
        shape = llama_config().to_dict()
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")  # fmt: skip
        return Qwen3MoeConfig(**{k: shape[k] for k in keep}, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=32, router_aux_loss_coef=0.05)  # fmt: skip
    if kind == "dynamic":
        return llama_config(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    mrope = {"mrope_section": [2, 3, 3], "rope_type": "default", "mrope_interleaved": True}
    text = {**llama_config(num_hidden_layers=2).to_dict(), "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "router_aux_loss_coef": 0.05, "rope_scaling": mrope}  # fmt: skip
    for key in ("model_type", "architectures", "transformers_version", "eos_token_id"):
        text.pop(key, None)
    return transformers.AutoConfig.for_model("qwen3_vl_moe", text_config=text)


@pytest.mark.parametrize(
    ("kind", "note"),
    [
        ("qwen3_moe", "output_router_logits False -> True"),
        ("dynamic", "dynamic RoPE: native positions"),
        pytest.param("qwen3_vl_moe", "output_router_logits False -> True", marks=pytest.mark.slow),
    ],
)
def test_router_loss_and_runtime_rope_are_checked(tmp_path, capsys, kind, note):
    """The whole loss (token + router loss) is compared, and dynamic RoPE runs past its native length: both
    printed PASS before hf_longctx.sequence although SP was off by 8e-4 (loss) and 0.7 (gradients). Dynamic RoPE
    on two packed rows: each document crosses the native length and is compared with it run alone, row by row
    (FAIL with the batch's longest document's frequencies for all)."""
    extra = {"qwen3_vl_moe": ["--batch-size", "2"], "dynamic": ["--batch-size", "2", "--packed"]}.get(kind, [])
    folder = write_config(tmp_path, sequence_ops_config(kind))
    code, out = run_check(capsys, "--model", str(folder), "--sp", "2", *extra)
    assert code == 0, out
    assert note in out, out
    assert out.strip().splitlines()[-1].startswith("PASS: SP=2 matches SP=1 for "), out


@pytest.mark.parametrize(("model_type", "sp"), [("qwen3_vl", 4), ("llava", 2)])
def test_vision_language_passes(tmp_path, capsys, model_type, sp):
    """Images straddling the shard boundaries, a row without images; the vision tower's gradients compared too.
    (Qwen2.5-VL goes through the same Qwen-VL path: its packed check is below.)"""
    folder = write_config(tmp_path, vlm_config(model_type))
    code, out = run_check(capsys, "--model", str(folder), "--sp", str(sp), "--batch-size", "2")
    assert code == 0, out
    assert "vision tower " in out and ("image token -> id 511" if model_type == "llava" else "ids 508..511") in out, out
    assert "vision tower sharded over the SP group: pixel rows per tower call on each rank" in out, out
    assert out.strip().splitlines()[-1].startswith(f"PASS: SP={sp} matches SP=1 for "), out

    if model_type == "llava":
        code, out = run_check(capsys, "--model", str(folder), "--sp", "2", "--packed")
        assert code == 2 and "Run the check without --packed" in out, out


def test_vision_language_packed_passes(tmp_path, capsys):
    """Three documents per row (per-document mRoPE positions), an image across the SP=2 boundary: against each
    document run alone with its images. (Qwen2.5-VL; Qwen3-VL's packed rows: test_vlm_packed.py.)"""
    folder = write_config(tmp_path, vlm_config("qwen2_5_vl"))
    code, out = run_check(capsys, "--model", str(folder), "--sp", "2", "--batch-size", "2", "--packed")
    assert code == 0, out
    assert "packed: 3 docs/row" in out, out
    assert out.strip().splitlines()[-1].startswith("PASS: SP=2 matches SP=1 for "), out


def test_heads_not_divisible_exits_2_without_launching(tmp_path, capsys, monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("nothing may be launched for invalid input")

    monkeypatch.setattr(hf_longctx.check.worker.subprocess, "Popen", no_launch)
    config = llama_config(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, head_dim=16)
    code, out = run_check(capsys, "--model", str(write_config(tmp_path, config)), "--sp", "2")
    assert code == 2, out
    assert "num_attention_heads (3) divisible by sp_size (2)" in out
    assert "valid sp_size values for this model: [1, 3]" in out

    code, out = run_check(capsys, "--model", str(tmp_path / "nowhere"), "--sp", "2")
    assert code == 2 and "no config.json there" in out, out


def test_injected_fault_fails_and_names_the_worst_parameters(tmp_path):
    """Self-test of the checker, through the real command line: broken SP must be reported."""
    model = write_config(tmp_path, llama_config())
    cmd = [sys.executable, "-m", "hf_longctx.cli", "check", "--model", str(model), "--sp", "2"]
    cmd += ["--inject-fault", "skip-positions"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    last = out.strip().splitlines()[-1]
    assert last.startswith("FAIL: SP=2 is not exact for LlamaForCausalLM: loss relative difference"), out
    assert "gradients differ by more than 1e-04 (worst" in last
    worst = out.split("max|g_sp - g_ref| / max|g_ref|:")[1].strip().splitlines()[:5]
    assert len(worst) == 5 and all(line.split()[1].startswith(("model.", "lm_head.")) for line in worst), out


def test_timeout_kills_the_run_and_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the check's temp dir, hence workers' argv
    model = write_config(tmp_path, llama_config())
    code = main(["check", "--model", str(model), "--sp", "2", "--timeout", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert out.strip().splitlines()[-1].startswith("FAIL: timed out"), out
    assert processes_mentioning(str(tmp_path)) == []

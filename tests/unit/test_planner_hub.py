"""`load_model_shape` and `hf-longctx plan --model Org/Name`: a Hub model id through the Hugging Face cache or the Hub.

The cache is a fake one in `tmp_path` laid out as huggingface_hub writes it (`models--Org--Name/refs/main`,
`snapshots/<rev>/config.json` linking into `blobs/`); the Hub is a monkeypatched `hf_hub_download` (no network).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError

from hf_longctx.planner.model_shape import load_model_shape

ROOT = Path(__file__).resolve().parents[2]
REPO = "Org/Tiny-LM"
CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1000,
}


def _fake_cache(cache: Path, repo: str = REPO, config: dict | None = None) -> Path:
    """A model's cache folder as huggingface_hub lays it out, holding only config.json."""
    folder, rev = cache / f"models--{repo.replace('/', '--')}", "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(rev)
    (folder / "blobs").mkdir()
    (folder / "blobs" / "f00d").write_text(json.dumps(config or CONFIG))
    (folder / "snapshots" / rev).mkdir(parents=True)
    (folder / "snapshots" / rev / "config.json").symlink_to(Path("..", "..", "blobs", "f00d"))
    return folder


def _no_hub(*args, **kwargs):
    raise AssertionError("the Hub was asked")


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty cache in tmp_path, offline, and a Hub that fails the test if asked."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _no_hub)
    return tmp_path / "hub"


def test_hub_id_resolves_from_the_cache_offline(hub):
    _fake_cache(hub)
    shape = load_model_shape(REPO)
    assert (shape.name, shape.hidden, shape.layers, shape.kv_heads, shape.qk_norm) == (REPO, 256, 2, 2, True)


def test_the_cache_answers_before_the_hub_when_online(hub, monkeypatch):
    _fake_cache(hub)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert load_model_shape(REPO).vocab == 1000


def test_shipped_names_come_before_the_cache(hub, monkeypatch):
    _fake_cache(hub, "qwen3-4b", {**CONFIG, "hidden_size": 64})
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", _no_hub)
    assert load_model_shape("qwen3-4b").hidden == 2560


def test_hub_id_downloads_config_json_only_when_online(hub, monkeypatch, tmp_path):
    asked = []

    def download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        (tmp_path / "config.json").write_text(json.dumps(CONFIG))
        return str(tmp_path / "config.json")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert load_model_shape(REPO).heads == 8 and asked == [(REPO, "config.json")]


def test_offline_miss_names_what_was_tried_and_the_fix(hub):
    with pytest.raises(ValueError) as err:
        load_model_shape(REPO)
    message = str(err.value)
    for part in (
        "llama3.1-8b",
        str(hub / "models--Org--Tiny-LM"),
        "HF_HUB_OFFLINE is set",
        "path of the model's config.json",
    ):
        assert part in message
    assert "(shipped)" not in message


@pytest.mark.parametrize(("repo", "short"), [("Qwen/Qwen3-8B", "qwen3-8b"), ("meta-llama/Llama-3.1-8B", "llama3.1-8b")])
def test_a_hub_id_of_a_shipped_model_names_the_shipped_name_when_missed(hub, repo, short):
    with pytest.raises(ValueError, match=f"Fix: --model {short} \\(shipped\\)"):
        load_model_shape(repo)


@pytest.mark.parametrize(
    "error, reason",
    [
        (
            LocalEntryNotFoundError("An error happened while trying to locate the file on the Hub"),
            "LocalEntryNotFoundError",
        ),
        (GatedRepoError("401 Client Error", response=SimpleNamespace(headers={}, request=None)), "HF_TOKEN"),
    ],
)
def test_hub_failure_names_the_hub_and_why(hub, monkeypatch, error, reason):
    def download(*args, **kwargs):
        raise error

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(ValueError, match="the Hub \\(https://") as err:
        load_model_shape(REPO)
    assert reason in str(err.value) and "Hugging Face cache" in str(err.value)


def test_a_missing_path_is_not_taken_for_a_hub_id(hub):
    with pytest.raises(ValueError, match="not a Hub model id") as err:
        load_model_shape("path/to/config.json")
    assert "path/to/config.json: no such file" in str(err.value)


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_cli_plans_a_cached_hub_id_from_the_environment_without_torch(tmp_path, variable):
    _fake_cache(tmp_path / "hub")
    home = {"HF_HOME": tmp_path, "HF_HUB_CACHE": tmp_path / "hub"}[variable]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update({variable: str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    probe = (
        "import sys\nfrom hf_longctx.cli import main\n"
        f"code = main(['plan', '--model', {REPO!r}, '--seq-len', '4096', '--sp', '2', '--json'])\n"
        "print([m for m in ('torch', 'transformers') if m in sys.modules], code)"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    *plan, last = out.stdout.strip().splitlines()
    assert last == "[] 0" and json.loads("\n".join(plan))["model"] == REPO

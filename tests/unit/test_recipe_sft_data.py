"""recipes/sft.py trains on the dataset named: an explicit `dataset_name` wins over the recipe's `long_documents`
(the GPU recipes set it), for a pretrained model and the tiny default alike; a pretrained model with neither stops
with an error naming both. The dataset is a local folder (`datasets.load_dataset` reads it offline)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sft(sft_recipe):
    return sft_recipe


def _folder(tmp_path: Path) -> str:
    rows = [{"text": f"row {i}"} for i in range(3)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path)


@pytest.mark.parametrize("model", ["Qwen/Qwen3-8B", None], ids=["pretrained", "tiny"])
def test_dataset_name_wins_over_long_documents(sft, tmp_path, monkeypatch, capsys, model):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(sft, "_documents", lambda *a: pytest.fail("long_documents used despite dataset_name"))
    lc = sft.LongContextArguments(model_name_or_path=model, dataset_name=_folder(tmp_path), long_documents=True)
    rows = sft._train_rows(None, SimpleNamespace(process_index=0, packing=True, max_length=64), lc)
    assert rows["text"] == ["row 0", "row 1", "row 2"]
    assert "(long_documents: true of the recipe unused)" in capsys.readouterr().out


def test_a_pretrained_model_without_data_names_both_options(sft):
    lc = sft.LongContextArguments(model_name_or_path="Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match="set dataset_name .* or long_documents: true"):
        sft._train_rows(None, SimpleNamespace(process_index=0, packing=True, max_length=64), lc)

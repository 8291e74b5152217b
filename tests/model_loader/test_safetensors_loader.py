"""The safetensors folder loader: single and sharded checkpoints, memory mapping, errors, progress."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from llmhal.model_loader.safetensors_loader import (
    CheckpointFilesError,
    checkpoint_files,
    iter_safetensors_weights,
)
from llmhal.testing.model_parity import save_tiny_model, tiny_config


def _as_dict(folder, **kw) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in iter_safetensors_weights(folder, **kw):
        assert name not in out, f"{name} yielded twice"
        out[name] = t
    return out


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_single_file_checkpoint(tmp_path):
    hf = save_tiny_model(tiny_config("LlamaForCausalLM", num_hidden_layers=1), tmp_path)
    assert checkpoint_files(tmp_path) == [tmp_path / "model.safetensors"]
    _assert_same(_as_dict(tmp_path, progress=False), hf.state_dict())


def test_sharded_checkpoint_with_index(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_config("Qwen2ForCausalLM", num_hidden_layers=2))
    hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    files = checkpoint_files(tmp_path)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    _assert_same(_as_dict(tmp_path, progress=False), hf.state_dict())


def test_missing_shard_names_the_file(tmp_path):
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFilesError, match="model-00002-of-00002.safetensors"):
        list(iter_safetensors_weights(tmp_path))


def test_folder_without_checkpoint_lists_what_it_found(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointFilesError) as err:
        list(iter_safetensors_weights(tmp_path))
    msg = str(err.value)
    assert "model.safetensors" in msg and "config.json" in msg


def test_bad_index_names_the_index(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        list(iter_safetensors_weights(tmp_path))


def test_tensors_are_memory_mapped_not_read(tmp_path):
    """A 64 MiB tensor costs (almost) no resident memory until its pages are touched."""
    save_file({"big": torch.ones(4096, 4096)}, str(tmp_path / "model.safetensors"))

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    before = rss_mib()
    (name, t), *_ = list(iter_safetensors_weights(tmp_path, progress=False))
    grew = rss_mib() - before
    assert name == "big" and t.shape == (4096, 4096)
    assert grew < 16, f"resident memory grew by {grew:.1f} MiB: the file was read, not mapped"
    assert float(t[4095, 4095]) == 1.0


def test_progress_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    _as_dict(tmp_path)  # stderr is captured, not a terminal: silent
    assert capsys.readouterr().err == ""
    _as_dict(tmp_path, progress=True)
    err = capsys.readouterr().err
    assert "2/2" in err

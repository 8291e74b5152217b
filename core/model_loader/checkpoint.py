"""A checkpoint as the engine sees it: config, tokenizer, quantization facts and a weight stream.

Two formats: a safetensors folder (transformers layout) and a GGUF file. Both give HF-style tensor
names, so model classes load either through the same ``load_weights``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmhal.model_loader.source import GGUF, ModelSource

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from llmhal.model_loader.progress import LoadProgress
    from llmhal.quantization.base import QuantizationConfig


class Checkpoint:
    """Base: subclasses fill ``hf_config`` and implement the loaders."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.hf_config: Any = None

    @property
    def quant_method(self) -> str | None:
        """The quantization method the checkpoint was saved with (None = unquantized)."""
        cfg = self.quant_config_dict
        if not cfg:
            return None
        method = cfg.get("quant_method")
        if not method:
            # Loading it as unquantized would fail later on tensor names (g_idx, qweight, ...).
            raise ValueError(
                f"{self.source.path}: config.json's quantization_config has no quant_method, so "
                f'the checkpoint\'s format is unknown; add it (e.g. "quant_method": "gptq")'
            )
        return str(method).lower()

    @property
    def quant_config_dict(self) -> dict[str, Any] | None:
        raw = getattr(self.hf_config, "quantization_config", None)
        if raw is None:
            return None
        return raw if isinstance(raw, dict) else raw.to_dict()

    def build_quant_config(self, cls: type[QuantizationConfig]) -> QuantizationConfig:
        return cls.from_config(self.quant_config_dict or {})

    def tokenizer(self, override: str | None = None) -> Any:
        raise NotImplementedError

    def weights(self, progress: LoadProgress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` pairs, counted on ``progress``'s line when given."""
        raise NotImplementedError

    @functools.cached_property
    def _generation_config(self) -> dict[str, Any]:
        """generation_config.json beside the weights ({} for GGUF files and folders without one);
        read once for both the EOS ids and the sampling defaults."""
        import json

        path = self.source.folder / "generation_config.json"
        if self.source.kind == GGUF or not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except ValueError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); fix or remove it") from None
        return data if isinstance(data, dict) else {}

    def generation_eos_token_ids(self) -> list[int]:
        """Extra EOS ids from generation_config.json (instruct models often list several)."""
        eos = self._generation_config.get("eos_token_id")
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, list) else [eos])]

    def generation_defaults(self) -> dict[str, Any]:
        """The sampling settings the model's authors recommend (generation_config.json), under
        SamplingParams' names: what vLLM uses when a request leaves them out. Only sampled
        generation's own settings are taken (do_sample=False, HF's greedy switch, is not)."""
        cfg = self._generation_config
        names = {
            "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
        }  # fmt: skip
        return {ours: cfg[theirs] for theirs, ours in names.items() if cfg.get(theirs) is not None}


class SafetensorsCheckpoint(Checkpoint):
    def __init__(self, source: ModelSource) -> None:
        super().__init__(source)
        import json

        from llmhal.model_loader.hf_config import DEFAULTS, config_for

        path = source.folder / "config.json"
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError):
            fields = None  # AutoConfig says what is wrong with it, as before
        if isinstance(fields, dict):
            qc = fields.get("quantization_config")
            if qc is not None and not isinstance(qc, dict):
                # (transformers fails obscurely on one that is not an object)
                raise ValueError(
                    f"{path}: quantization_config must be an object with a quant_method, got {qc!r}"
                )
            # The built-in architectures without importing their config classes (~1.6 s); any
            # other model type, or remote code, through AutoConfig.
            if fields.get("model_type") in DEFAULTS and "auto_map" not in fields:
                self.hf_config = config_for(fields["model_type"], fields)
                self.hf_config._name_or_path = str(source.folder)  # as AutoConfig sets it
                return
        from transformers import AutoConfig

        with _no_remote_code(source.folder):
            self.hf_config = AutoConfig.from_pretrained(
                str(source.folder), local_files_only=True, trust_remote_code=False
            )

    def tokenizer(self, override: str | None = None) -> Any:
        where = override or str(self.source.folder)
        # AutoTokenizer loads the model's config (importing its class) unless given one. Ours is
        # given only where it cannot change the choice of tokenizer class: tokenizer_config.json
        # names the class and no remote code is involved (otherwise transformers consults its
        # per-class tables, which know the config by its class).
        from llmhal.model_loader.hf_config import built_here

        declared = _declared_tokenizer_class(Path(where))
        config = self.hf_config if built_here(self.hf_config) and declared else None
        return _local_tokenizer(where, override is not None, config=config)

    def weights(self, progress: LoadProgress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        from llmhal.model_loader.safetensors_loader import iter_safetensors_weights

        return iter_safetensors_weights(self.source.folder, progress=progress or False)


class GGUFCheckpoint(Checkpoint):
    def __init__(self, source: ModelSource) -> None:
        super().__init__(source)
        from llmhal.model_loader.gguf_loader import GGUFFile

        self.gguf = GGUFFile(source.path)
        self.hf_config = self.gguf.hf_config()

    @property
    def quant_method(self) -> str | None:
        return "gguf"

    @property
    def quant_config_dict(self) -> dict[str, Any] | None:
        return {"quant_method": "gguf"}

    def build_quant_config(self, cls: type[QuantizationConfig]) -> QuantizationConfig:
        return self.gguf.quant_config()

    def tokenizer(self, override: str | None = None) -> Any:
        if override:
            return _local_tokenizer(override, True)
        return self.gguf.tokenizer()

    def weights(self, progress: LoadProgress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if progress is None:
            return self.gguf.weights()
        return progress.tensors(self.gguf.weights(), len(self.gguf.tensors))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _local_tokenizer(where: str, explicit: bool, config: Any = None) -> Any:
    """transformers' tokenizer from a local folder; a missing folder or one without tokenizer files
    is an error naming them and the remedy (transformers' own words are about hub repo ids or
    missing libraries)."""
    from transformers import AutoTokenizer

    folder = Path(where)
    if explicit and not folder.exists():
        raise ValueError(
            f"tokenizer={where!r} does not exist on this machine (llmhal never downloads); pass a "
            f"local folder holding the tokenizer's files"
        )
    if folder.is_dir() and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        whose = "the tokenizer folder" if explicit else "the model folder"
        raise ValueError(
            f"{where} ({whose}) has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); copy them "
            f"there, or pass tokenizer=<a folder with them> (CLI: --tokenizer)"
        )
    extra = {} if config is None else {"config": config}
    with _no_remote_code(folder):
        return AutoTokenizer.from_pretrained(
            where, local_files_only=True, trust_remote_code=False, **extra
        )


@contextlib.contextmanager
def _no_remote_code(folder: Path) -> Iterator[None]:
    """A checkpoint's own Python code (``auto_map``) is never run: said plainly. Passing
    ``trust_remote_code=False`` matters: left unset, transformers asks on stdin whether to run
    the code, and runs it on "y"."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"{folder} needs its own Python code (auto_map) to load, and llmhal never runs a "
            f"checkpoint's code (trust_remote_code is accepted and ignored); use a model whose "
            f"architecture llmhal implements, or register one: ModelRegistry.register_model"
        ) from None


def _declared_tokenizer_class(folder: Path) -> bool:
    """Whether ``folder``'s tokenizer_config.json names its tokenizer class, without remote code."""
    import json

    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and bool(cfg.get("tokenizer_class")) and "auto_map" not in cfg


def open_checkpoint(source: ModelSource) -> Checkpoint:
    return GGUFCheckpoint(source) if source.kind == GGUF else SafetensorsCheckpoint(source)

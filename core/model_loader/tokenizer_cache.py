"""GGUF files' converted tokenizers, kept under ``$LLMHAL_CACHE_DIR/tokenizers``.

Building a tokenizer from a GGUF file's vocabulary took ~1.8 s of the default model's load
(transformers re-reads the file's metadata and scans its model modules); loading the saved one
takes ~0.6 s. An entry is keyed by the file (path, size, mtime) and the transformers and tokenizers
versions that built it, written through a temporary folder renamed into place with a completion
marker written last, and the :data:`MAX_ENTRIES` most recently used are kept. A damaged or
incomplete entry is rebuilt; a cache that cannot be written is skipped.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llmhal.logger import init_logger

logger = init_logger(__name__)

# Converted tokenizers kept at most (a few MB each for real vocabularies).
MAX_ENTRIES = 16
# Written last into an entry: one without it is incomplete or damaged.
_COMPLETE = "complete"


def entry_for(path: Path) -> Path | None:
    """Where the tokenizer converted from the GGUF file ``path`` is kept (None: ``path`` cannot
    be read)."""
    import tokenizers
    import transformers

    from llmhal.envs import cache_root

    try:
        st = path.stat()
    except OSError:
        return None
    key = "|".join(map(str, (path.resolve(), st.st_size, st.st_mtime_ns,
                             transformers.__version__, tokenizers.__version__)))  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_root() / "tokenizers" / f"{path.stem}-{digest}"


def load(entry: Path, what: str) -> Any | None:
    """The tokenizer kept in ``entry``, or None when there is none complete (``what`` names it in
    the warning about a damaged one)."""
    from transformers import PreTrainedTokenizerFast

    if not (entry / _COMPLETE).is_file():
        return None
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
    except Exception as e:  # a damaged entry: the caller rebuilds it
        logger.warning("Rebuilding the cached tokenizer of %s (%s)", what, e)
        return None
    try:
        os.utime(entry)  # used now: the modification time orders the evictions
    except OSError:
        pass
    return tok


def save(tok: Any, entry: Path, *, replace: bool = False) -> None:
    """Save ``tok`` as ``entry`` through a temporary sibling renamed into place, so a reader never
    sees half a tokenizer. An entry already there stays (another process wrote it first) unless
    ``replace`` (it failed to load). A cache that cannot be written is skipped: the next load
    converts again."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep a shared cache from other users
            tok.save_pretrained(str(tmp))
            (tmp / _COMPLETE).write_text("")
            if replace and entry.exists():  # move the damaged entry aside in one step
                os.replace(entry, tmp.with_name(tmp.name + ".old"))
                shutil.rmtree(tmp.with_name(tmp.name + ".old"), ignore_errors=True)
            os.replace(tmp, entry)  # fails if another process's entry is there: it is kept
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # The least recently used entries beyond the limit go (files move, tests write many).
        entries = sorted(entry.parent.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        logger.debug("Not caching the tokenizer in %s: %s", entry, e)

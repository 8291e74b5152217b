"""GGUF files' converted tokenizers, kept under ``$LLMHAL_CACHE_DIR/tokenizers``.

Building a tokenizer from a GGUF file's vocabulary took ~1.8 s of the default model's load
(transformers re-reads the file's metadata and scans its model modules); loading the saved one
takes ~0.6 s. An entry is keyed by the file (path, size, mtime) and the transformers and tokenizers
versions that built it, written through a temporary folder renamed into place with a completion
marker written last, and the :data:`MAX_ENTRIES` most recently used are kept. A damaged or
incomplete entry is rebuilt; a cache that cannot be written is skipped.

A cached tokenizer (its vocabulary, its chat template) decides every prompt, so an entry is read
back only when nobody else could have written it (:mod:`llmhal.utils.private_dir`): the cache root,
``tokenizers``, the entry and each of its files are the user's (or root's), not writable by group
or others, and not symbolic links. An entry that fails is converted again and replaced; a folder
above it that fails is not used at all (the tokenizer is converted on each load, with one warning).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llmhal.logger import init_logger
from llmhal.utils import private_dir

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


def _folder(entry: Path, *, create: bool) -> Path | None:
    """The checked ``tokenizers`` folder holding ``entry``, or None when it may not be used."""
    try:
        return private_dir.ensure(entry.parent.parent, entry.parent.name, create=create)
    except private_dir.UnsafeDirError as e:
        private_dir.warn_once(entry.parent, str(e), "Tokenizers are converted on every load")
    except OSError as e:  # missing, or cannot be created: nothing cached there
        logger.debug("Not using the tokenizer cache %s: %s", entry.parent, e)
    return None


def _untrusted(entry: Path) -> str | None:
    """Why the entry there may not be read back, or None (also when there is none)."""
    return private_dir.entry_problem(entry)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def load(entry: Path, what: str) -> Any | None:
    """The tokenizer kept in ``entry``, or None when there is none complete that may be trusted
    (``what`` names it in the warning about a damaged one)."""
    from transformers import PreTrainedTokenizerFast

    if _folder(entry, create=False) is None:
        return None
    problem = _untrusted(entry)
    if problem is not None:
        private_dir.warn_once(entry, problem, "The tokenizer is converted again and replaced")
        return None
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
    ``replace`` (it failed to load) or it may not be trusted. A cache that cannot be written, or
    may not be used, is skipped: the next load converts again."""
    if _folder(entry, create=True) is None:
        return
    replace = replace or _untrusted(entry) is not None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=entry.name + ".", dir=entry.parent))  # mode 0700
        try:
            tok.save_pretrained(str(tmp))
            (tmp / _COMPLETE).write_text("")
            if replace and os.path.lexists(entry):  # move the bad entry aside in one step
                os.replace(entry, tmp.with_name(tmp.name + ".old"))
                _remove(tmp.with_name(tmp.name + ".old"))
            os.replace(tmp, entry)  # fails if another process's entry is there: it is kept
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # The least recently used entries beyond the limit go (files move, tests write many).
        entries = sorted(entry.parent.iterdir(), key=lambda p: p.lstat().st_mtime, reverse=True)
        for old in entries[MAX_ENTRIES:]:
            _remove(old)
    except OSError as e:
        logger.debug("Not caching the tokenizer in %s: %s", entry, e)

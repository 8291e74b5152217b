"""Cache folders that llmhal reads code or data back from: only the user's own are trusted.

A cached kernel is loaded into the process and a cached tokenizer decides every prompt, so a cache
that someone else could have written is someone else's code. The rule (the one ssh applies to
``~/.ssh`` and pip to its cache): every folder from the cache root down, and every file read
back, is owned by the current user (or by root, who could replace llmhal itself) and is not
writable by group or others. Below the root nothing is reached through a symbolic link: a link in
place of an entry is a failure, never followed. The root itself may be a link the user made
(``LLMHAL_CACHE_DIR`` pointing at a scratch disk); what it points to must pass the rule, unless the
root sits in a shared temporary folder, where nothing is followed. No folder above the root may be
writable by anyone without the sticky bit (there anyone could rename the cache aside and put
another in its place). Folders llmhal creates get mode 0700, and nobody can then change what is in
them.

A folder that fails is not used: the caller builds into :func:`fresh_dir` (a new ``mkdtemp``
folder for this process) or does not cache. :func:`warn_once` says why, once per folder and
process, with the remedy. Callers::

    folder = private_dir.ensure(cache_root(), "grammars")   # raises UnsafeDirError / OSError
    if private_dir.file_problem(folder / name) is None: ...  # then read it
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

from llmhal.logger import init_logger

logger = init_logger(__name__)

_warned: set[str] = set()
_fresh: dict[str, Path] = {}
_lock = threading.Lock()


class UnsafeDirError(PermissionError):
    """A cache folder or file someone else could write: not used. The message says why."""


def _owners() -> tuple[int, ...]:
    return (os.getuid(), 0) if hasattr(os, "getuid") else ()


def stat_problem(st: os.stat_result, path: Path | str) -> str | None:
    """Why the file or folder with status ``st`` may not be trusted, or None."""
    owners = _owners()
    if owners and st.st_uid not in owners:
        return f"{path} is owned by uid {st.st_uid}, not by you (uid {owners[0]}) or root"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def path_problem(path: Path, *, kind: str, follow: bool = False) -> str | None:
    """Why ``path`` (``kind`` ``"dir"`` or ``"file"``) may not be trusted, or None. A missing path
    raises FileNotFoundError; a symbolic link is a problem unless ``follow``."""
    st = os.stat(path) if follow else os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link (a cache entry never is)"
    want = stat.S_ISDIR if kind == "dir" else stat.S_ISREG
    if not want(st.st_mode):
        return f"{path} is not a {'folder' if kind == 'dir' else 'regular file'}"
    return stat_problem(st, path)


def file_problem(path: Path) -> str | None:
    """Why the cached file ``path`` may not be read back, or None (FileNotFoundError: none there).
    Call it after :func:`ensure` checked its folder, which nobody else can then change."""
    return path_problem(path, kind="file")


def open_file(path: Path) -> int:
    """A read-only descriptor of the cached file ``path``, checked by the rule on what was opened.

    The check and the read are then about the same file: a name checked and then opened again
    could meanwhile be swapped (by whoever can rename entries in a folder above the cache) for
    someone else's file. A link is never followed and a FIFO never blocks. Raises
    FileNotFoundError when there is none and :class:`UnsafeDirError` when it fails the rule; the
    caller closes the descriptor.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(path):  # ELOOP
            raise UnsafeDirError(f"{path} is a symbolic link (a cache entry never is)") from e
        raise
    try:
        st = os.fstat(fd)
        problem = (
            stat_problem(st, path) if stat.S_ISREG(st.st_mode) else f"{path} is not a regular file"
        )
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise UnsafeDirError(problem)
    return fd


def tree_problem(folder: Path) -> str | None:
    """Why the cache entry ``folder`` (files and folders, read back as a whole) may not be
    trusted, or None."""
    problem = path_problem(folder, kind="dir")
    if problem is not None:
        return problem
    for child in folder.iterdir():
        st = os.lstat(child)
        problem = tree_problem(child) if stat.S_ISDIR(st.st_mode) else file_problem(child)
        if problem is not None:
            return problem
    return None


def entry_problem(path: Path) -> str | None:
    """Why the cache entry ``path`` (a file, or a folder read back as a whole) may not be
    trusted; None when it may, or when there is none."""
    try:
        st = os.lstat(path)
        return tree_problem(path) if stat.S_ISDIR(st.st_mode) else file_problem(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path} cannot be checked ({e})"


def discard_untrusted(path: Path, instead: str) -> None:
    """Remove the cache entry ``path`` when it may not be trusted (saying once why, and what is
    done ``instead``), so the caller builds it again. Call it inside a folder :func:`ensure`
    checked: only the user could have put anything there since."""
    problem = entry_problem(path)
    if problem is None:
        return
    warn_once(path, problem, instead)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def in_shared_temp(path: Path) -> bool:
    """Whether ``path`` lies directly in a sticky, world-writable folder such as /tmp (where
    anyone can create the name first)."""
    try:
        st = os.stat(path.parent)
    except OSError:
        return False
    return bool(st.st_mode & stat.S_ISVTX) or bool(st.st_mode & stat.S_IWOTH)


def ancestor_problem(root: Path) -> str | None:
    """Why a folder above the cache ``root`` lets someone else replace the cache, or None: one that
    anybody may write and that lacks the sticky bit, where anyone can rename ``root`` (or a folder
    on the way to it) aside and put their own in its place between a check and a read."""
    seen: set[Path] = set()
    for start in (Path(os.path.abspath(root)), Path(os.path.realpath(root))):
        for folder in start.parents:
            if folder in seen:
                continue
            seen.add(folder)
            try:
                mode = os.stat(folder).st_mode
            except OSError:
                continue
            if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
                return (
                    f"{folder}, a folder above it, is writable by anyone without the sticky bit "
                    f"(mode {stat.S_IMODE(mode):o}), so anyone can put another folder in its place"
                )
    return None


def _mkdir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass


def ensure(root: Path, *parts: str, create: bool = True) -> Path:
    """``root/part/...``, each level checked by the rule; missing levels are created with mode
    0700 (with ``create``; else a missing level raises FileNotFoundError).

    Raises :class:`UnsafeDirError` when a level fails (the folder must not be used), and OSError
    when it cannot be created.
    """
    follow = not in_shared_temp(root)
    if create and not os.path.lexists(root):
        root.parent.mkdir(parents=True, exist_ok=True)  # above the cache: not llmhal's to judge
        _mkdir(root)
    problem = ancestor_problem(root) or path_problem(root, kind="dir", follow=follow)
    path = root
    for part in parts:
        if problem is not None:
            break  # nothing is created inside a folder that is not the user's
        path = path / part
        if create:
            _mkdir(path)
        problem = path_problem(path, kind="dir")
    if problem is not None:
        raise UnsafeDirError(problem)
    return path


def warn_once(path: Path, problem: str, instead: str) -> None:
    """Log once per ``path`` and process why the cache there is not used, what is done
    ``instead``, and the remedy."""
    with _lock:
        if str(path) in _warned:
            return
        _warned.add(str(path))
    logger.warning(
        "Not using the cache at %s: %s. %s. To cache there again, remove it or make it yours and "
        "not writable by others (chown, chmod go-w), or set LLMHAL_CACHE_DIR to a folder of your "
        "own.",
        path,
        problem,
        instead,
    )


def fresh_dir(purpose: str) -> Path:
    """A new private folder for this process (``mkdtemp``: mode 0700, an unpredictable name),
    the same one for each ``purpose``; removed when the process exits."""
    with _lock:
        if purpose not in _fresh or not _fresh[purpose].is_dir():
            path = Path(tempfile.mkdtemp(prefix=f"llmhal-{purpose}-"))
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            _fresh[purpose] = path
        return _fresh[purpose]

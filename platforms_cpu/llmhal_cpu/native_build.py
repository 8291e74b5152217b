"""Build, cache and load the CPU platform's native kernels (plain C++ with OpenMP, through ctypes).

The kernels include no torch headers, so each compiles in a second or two with the system compiler
and needs neither ninja nor a torch build environment. They are compiled for the host CPU
(``-march=native``); the cache key covers the source, the flags, the compiler's version and the
CPU's ISA flags, so a cache folder shared between different machines never hands one a binary built
for another. A kernel is built beside its final name and renamed into place, so concurrent processes
never load a half-written file. The kernels link the same libgomp as torch (same soname), so their
parallel regions share torch's thread pool: see ``kernels/quant_gemm.cpp`` for the rule that keeps
that pool from spinning.

Environment (read at each build, never cached at import):

* ``LLMHAL_CACHE_DIR``: where built kernels are kept (default ``$XDG_CACHE_HOME/llmhal`` or
  ``~/.cache/llmhal``); a folder that cannot be written falls back to ``$TMPDIR/llmhal-<uid>``.
  A folder someone else could have written is never used (see :func:`build`).
* ``LLMHAL_CPU_KERNEL_ARCH``: target flags replacing ``-march=native``, e.g. ``-march=haswell`` to
  build and check the AVX2 code paths on an AVX-512 host, or ``-march=x86-64`` for the baseline.
* ``CXX``: the C++ compiler (default ``c++``, then ``g++``, then ``clang++``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from llmhal.envs import cache_root
from llmhal.logger import init_logger
from llmhal.utils import private_dir
from llmhal_cpu import cpuinfo

logger = init_logger(__name__)

BASE_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-fno-math-errno",
    "-ffp-contract=fast",  # ISO mode would otherwise forbid fusing a * b + c into an FMA
)


def cache_dir() -> Path:
    """The preferred folder for built kernels (it may not exist or be writable yet)."""
    return cache_root() / "kernels"


def compiler() -> str | None:
    """Path of the C++ compiler to use, or None when there is none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def arch_flags() -> list[str]:
    """Target flags: ``LLMHAL_CPU_KERNEL_ARCH`` when set, else the host's native ISA."""
    override = os.environ.get("LLMHAL_CPU_KERNEL_ARCH")
    if override is not None:
        return override.split()
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return ["-mcpu=native"]
    if machine in ("x86_64", "amd64", "i686"):
        return ["-march=native"]
    return []


def kernel_name(source: Path, stem: str, cxx: str) -> str:
    """The file name of the library built from ``source``: ``<stem>-<key>.so``, the key a hash of
    everything that changes the binary. Anyone can derive it: it is no secret, and the cache is
    trusted by its ownership (see :func:`build`), never by its names."""
    # The kernels include the package's shared headers (kernels/*.h): they are part of the source.
    headers = sorted(Path(__file__).parent.glob("kernels/*.h"))
    src = b"\0".join([source.read_bytes(), *(h.read_bytes() for h in headers)])
    flags = [*BASE_FLAGS, *arch_flags()]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        b"\0".join(
            [
                src,
                " ".join(flags).encode(),
                version.encode(),
                platform.machine().encode(),
                " ".join(sorted(cpuinfo.cpu_flags())).encode(),
            ]
        )
    ).hexdigest()[:16]
    return f"{stem}-{key}.so"


def fallback_root() -> Path:
    """The per-user folder in the temp directory used when the cache root cannot be written (a
    read-only home in a container). Its name is predictable, so it is used only when it passes
    the ownership rule."""
    user = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"llmhal-{user}"


def _cached(folder: Path, name: str) -> Path | None:
    """``folder/name`` when it is there and may be loaded; a file that may not is rebuilt (the
    rename replaces it, or the link planted in its place, without following it)."""
    out = folder / name
    try:
        problem = private_dir.file_problem(out)
    except FileNotFoundError:
        return None
    if problem is None:
        return out
    private_dir.warn_once(out, problem, "The kernel is built again in its place")
    return None


def build(source: Path, stem: str, cxx: str) -> Path:
    """The shared library built from ``source`` (from the cache when already built).

    Only a cache nobody else could have written is used (:mod:`llmhal.utils.private_dir`): the
    cache root, its ``kernels`` folder and the library are the user's (or root's) and not writable
    by group or others, and no link is followed. A folder that fails is skipped, with one warning;
    when neither the cache root nor the temp fallback can be used, the kernel is built into a
    fresh private folder for this process. Raises RuntimeError when the compiler fails (its last
    output lines are in the message).
    """
    name = kernel_name(source, stem, cxx)
    flags = [*BASE_FLAGS, *arch_flags()]
    for root in (cache_root(), fallback_root()):
        try:
            folder = private_dir.ensure(root, "kernels")
        except private_dir.UnsafeDirError as e:
            private_dir.warn_once(root, str(e), "Kernels are built in another, private folder")
            continue
        except OSError as e:  # cannot be created: a read-only home
            logger.debug("Cannot build into %s (%s)", root, e)
            continue
        out = _cached(folder, name)
        if out is not None:
            return out
        try:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError as e:  # a shared cache someone else fills: readable, not writable
            logger.debug("Cannot build into %s (%s)", folder, e)
            continue
        break
    else:
        folder = private_dir.fresh_dir("kernels")
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    out = folder / name
    os.close(fd)
    # Shown by default: on a small machine quant_gemm alone compiles for ~25 s, which otherwise
    # looks like a hang after the loading bar reached 100%.
    logger.warning(
        "Compiling the native CPU kernel %s for this CPU: first use only, up to ~30 s on 2 idle "
        "cores, minutes on busy ones (cached in %s; `llmhal warmup` builds every kernel ahead)",
        stem,
        folder,
    )
    started = time.perf_counter()
    try:
        proc = subprocess.run(
            [cxx, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        # Concurrent builders each rename a complete file into place: a reader never sees half.
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info(
        "Built the native CPU kernel %s in %.1f s: %s", stem, time.perf_counter() - started, out
    )
    return out


# Descriptors of the loaded kernels, held for the life of the process: glibc knows a library by
# the name it was opened under, so a /proc/self/fd/N reused after a close would hand back the
# first library for the second.
_held_fds: list[int] = []


def open_library(path: Path) -> ctypes.CDLL:
    """Load the library file ``path`` through a descriptor checked by the cache rule, so what is
    loaded is the file that was checked, never one swapped in under its name after the check.
    Raises :class:`llmhal.utils.private_dir.UnsafeDirError` when it fails the rule."""
    fd = private_dir.open_file(path)
    by_fd = f"/proc/self/fd/{fd}"
    if not os.path.exists(by_fd):  # no procfs (not Linux): the path, checked just now
        os.close(fd)
        return ctypes.CDLL(str(path))
    try:
        lib = ctypes.CDLL(by_fd)
    except BaseException:
        os.close(fd)
        raise
    _held_fds.append(fd)
    return lib


def load(
    source: Path, stem: str, cxx: str | None, setup: Callable[[ctypes.CDLL], None]
) -> tuple[ctypes.CDLL | None, str]:
    """(library, ``"ok"``) or (None, why it cannot be used); never raises.

    ``setup`` declares the library's argument types and checks what it can (e.g. a struct size); an
    exception from it makes the library unusable, with its message as the reason.
    """
    if cxx is None:
        return None, "no C++ compiler found (set CXX or install g++/clang++)"
    try:
        lib = open_library(build(source, stem, cxx))
        setup(lib)
    except Exception as e:  # any failure means: use the torch fallbacks, and say why
        return None, f"{type(e).__name__}: {e}"
    return lib, "ok"


def declare_struct_calls(lib: ctypes.CDLL, names: Iterable[str], sizes: dict[type, int]) -> None:
    """Declare ``int name(const void* args)`` for each of ``names`` (the struct forms that
    ``step_graph.launch`` calls) and check that every ctypes mirror in ``sizes`` has the size the
    library reports for its C struct; a mismatch raises (``load`` then reports the library as
    unusable instead of letting a call read the wrong fields)."""
    for name in names:
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    for struct, size in sizes.items():
        if size != ctypes.sizeof(struct):
            raise RuntimeError(
                f"{struct.__name__} layout mismatch ({size} vs {ctypes.sizeof(struct)} bytes)"
            )


class KernelLibrary:
    """One native kernel: built and loaded on first use, once per process (thread-safe).

    ``get()`` returns the loaded library, or None when it cannot (or may not) be used. ``status`` is
    None before the first attempt, then ``"ok"`` or why the library cannot be used. A variable
    named by ``disable_env`` set to ``0`` turns the kernel off (checked on every ``get``).
    ``on_unavailable(status)`` runs once when loading fails. ``source`` and ``compiler`` are
    attributes, and ``lib``/``status`` plain fields, so tests can swap or reset them.
    """

    def __init__(
        self,
        source: Path,
        stem: str,
        setup: Callable[[ctypes.CDLL], None],
        *,
        disable_env: str | None = None,
        on_unavailable: Callable[[str], None] | None = None,
    ) -> None:
        self.source = source
        self.stem = stem
        self.setup = setup
        self.disable_env = disable_env
        self.on_unavailable = on_unavailable
        self.compiler: Callable[[], str | None] = compiler
        self.lib: ctypes.CDLL | None = None
        self.status: str | None = None
        self._lock = threading.Lock()

    def disabled(self) -> bool:
        return bool(self.disable_env) and os.environ.get(self.disable_env, "1").strip() == "0"

    def get(self) -> ctypes.CDLL | None:
        if self.disabled():
            return None
        if self.status is None:
            with self._lock:
                if self.status is None:
                    lib, status = load(self.source, self.stem, self.compiler(), self.setup)
                    self.lib = lib  # before status: readers test status, then take lib
                    self.status = status
                    if lib is None and self.on_unavailable is not None:
                        self.on_unavailable(status)
        return self.lib

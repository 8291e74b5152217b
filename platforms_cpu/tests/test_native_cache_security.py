"""Native kernels are loaded only from caches that nobody else could have written.

The fast tests build a stand-in kernel (one exported function, compiled in well under a second)
through the same ``native_build.load`` as the real kernels, so they never recompile those. An
attacker's library is planted under the name ``build`` derives for it, with a constructor that
writes a marker file: the marker must never appear, and the function must still give the right
answer (the planted one answers wrongly). The planting needs root (files owned by ``nobody``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from llmhal.utils import private_dir
from llmhal_cpu import native_build

NOBODY = 65534
STANDIN = 'extern "C" int llmhal_standin_add(int a, int b) { return a + b; }\n'
PLANTED = """#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
    const char* marker = std::getenv("LLMHAL_TEST_MARKER");
    if (FILE* f = marker ? std::fopen(marker, "w") : nullptr) { std::fputs("ran", f); std::fclose(f); }
}
extern "C" int llmhal_standin_add(int a, int b) { return a - b; }
"""

as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="planting files owned by another user needs root",
)


def _setup(lib: ctypes.CDLL) -> None:
    lib.llmhal_standin_add.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.llmhal_standin_add.restype = ctypes.c_int


class Kit:
    """The stand-in's source, the cache name ``build`` gives it, and the attacker's library."""

    def __init__(self, root: Path, cxx: str) -> None:
        self.cxx = cxx
        self.source = root / "standin.cpp"
        self.source.write_text(STANDIN)
        planted_src = root / "planted.cpp"
        planted_src.write_text(PLANTED)
        self.planted = root / "planted.so"
        cmd = [cxx, "-shared", "-fPIC", str(planted_src), "-o", str(self.planted)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        # The name is derivable by anyone (source, flags, compiler, CPU): take it from a real build.
        scratch = root / "scratch"
        os.environ["LLMHAL_CACHE_DIR"] = str(scratch)
        try:
            self.name = native_build.build(self.source, "standin", cxx).name
        finally:
            del os.environ["LLMHAL_CACHE_DIR"]
        shutil.rmtree(scratch)

    def load(self) -> ctypes.CDLL:
        """Load the stand-in as the platform loads a kernel; it must work and be the real one."""
        marker = Path(os.environ["LLMHAL_TEST_MARKER"])
        lib, status = native_build.load(self.source, "standin", self.cxx, _setup)
        assert lib is not None, status
        assert not marker.exists(), "the planted library's constructor ran"
        assert lib.llmhal_standin_add(2, 3) == 5
        return lib

    def plant(self, folder: Path, *, mode: int = 0o777, names: list[str] | None = None) -> Path:
        """An attacker's cache: the library as ``folder/kernels/<name>`` for each of ``names``
        (default: the stand-in's), all owned by nobody, the folders with ``mode``."""
        (folder / "kernels").mkdir(parents=True, exist_ok=True)
        targets = [folder / "kernels" / name for name in names or [self.name]]
        for target in targets:
            shutil.copy(self.planted, target)
        for path, m in ((folder, mode), (folder / "kernels", mode), *((t, 0o755) for t in targets)):
            os.chown(path, NOBODY, NOBODY)
            os.chmod(path, m)
        return targets[0]


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Kit:
    cxx = native_build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    return Kit(tmp_path_factory.mktemp("kit"), cxx)


@pytest.fixture(autouse=True)
def marker(tmp_path, monkeypatch) -> Path:
    """Where a planted library's constructor writes when it runs (one per test); each test also
    starts with no private folder made and no warning given yet in this process."""
    monkeypatch.setenv("LLMHAL_TEST_MARKER", str(tmp_path / "marker"))
    monkeypatch.setattr(private_dir, "_fresh", {})
    monkeypatch.setattr(private_dir, "_warned", set())
    return tmp_path / "marker"


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch) -> Path:
    """A world-writable, sticky temporary folder (as /tmp is) that tempfile uses."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    folder.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _unwritable(tmp_path: Path) -> str:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return str(blocker / "cache")


@as_root
@pytest.mark.parametrize("mode", [0o777, 0o755], ids=["world-writable", "foreign"])
def test_a_planted_kernel_in_LLMHAL_CACHE_DIR_never_runs(kit, tmp_path, shared_tmp, monkeypatch,
                                                         mode):  # fmt: skip
    attacker = tmp_path / "attacker"
    planted = kit.plant(attacker, mode=mode)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(attacker))
    kit.load()
    assert planted.stat().st_uid == NOBODY  # left alone, not overwritten through
    # Built in the user's own fallback instead, created private.
    (built,) = shared_tmp.glob(f"llmhal-{os.getuid()}/kernels/{kit.name}")
    assert built.stat().st_uid == os.getuid()
    assert stat.S_IMODE(built.parent.stat().st_mode) == 0o700


@as_root
@pytest.mark.parametrize("mode", [0o777, 0o755], ids=["world-writable", "foreign"])
def test_a_planted_kernel_in_the_temp_fallback_never_runs(kit, tmp_path, shared_tmp, monkeypatch,
                                                          mode, caplog):  # fmt: skip
    kit.plant(shared_tmp / f"llmhal-{os.getuid()}", mode=mode)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", _unwritable(tmp_path))
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        kit.load()
        kit.load()
    # Built into a fresh private folder, and the log says once why the fallback was not used.
    (built,) = shared_tmp.glob(f"llmhal-kernels-*/{kit.name}")
    assert stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    why = [r.getMessage() for r in caplog.records if f"llmhal-{os.getuid()}" in r.getMessage()]
    assert len(why) == 1 and "owned by uid 65534" in why[0], why


@as_root
def test_a_symlink_planted_as_the_kernel_is_not_followed(kit, tmp_path, shared_tmp, monkeypatch,
                                                         caplog):  # fmt: skip
    # The user's own cache, with a link in place of the kernel (planted while it was open, say).
    ours = tmp_path / "ours"
    (ours / "kernels").mkdir(parents=True, mode=0o700)
    link = ours / "kernels" / kit.name
    evil = kit.plant(shared_tmp / "evil")
    link.symlink_to(evil)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(ours))
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        kit.load()
    assert any(f"{link} is a symbolic link" in r.getMessage() for r in caplog.records)
    assert not link.is_symlink() and link.stat().st_uid == os.getuid()  # replaced by a build
    assert evil.read_bytes() == kit.planted.read_bytes()  # the link's target was left alone


@as_root
def test_a_symlink_planted_as_the_temp_fallback_is_not_followed(kit, tmp_path, shared_tmp,
                                                                monkeypatch, caplog):  # fmt: skip
    evil = shared_tmp / "evil"
    kit.plant(evil)
    (shared_tmp / f"llmhal-{os.getuid()}").symlink_to(evil)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", _unwritable(tmp_path))
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        kit.load()
    assert any("is a symbolic link" in r.getMessage() for r in caplog.records)
    assert list(shared_tmp.glob(f"llmhal-kernels-*/{kit.name}"))


@pytest.mark.parametrize("owner", ["loose", pytest.param("foreign", marks=as_root)])
def test_a_foreign_or_loose_file_in_the_users_cache_is_rebuilt(kit, tmp_path, monkeypatch, owner):
    ours = tmp_path / "ours"
    (ours / "kernels").mkdir(parents=True, mode=0o700)
    stale = ours / "kernels" / kit.name
    shutil.copy(kit.planted, stale)
    if owner == "loose":
        stale.chmod(0o777)  # writable by anyone: whatever is in it now is not trusted
    else:
        os.chown(stale, NOBODY, NOBODY)  # left by another user while the folder was open
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(ours))
    kit.load()
    assert stale.stat().st_uid == os.getuid() and stat.S_IMODE(stale.stat().st_mode) == 0o755


@pytest.mark.parametrize("swap", ["link", pytest.param("foreign", marks=as_root)])
def test_a_kernel_swapped_after_its_check_is_not_loaded(kit, tmp_path, monkeypatch, marker, swap):
    # The window between checking the cached file and loading it: whoever can rename entries in a
    # folder above the cache can put another file under the checked name. The library is loaded
    # through the descriptor that was checked, so the swapped-in file is refused, never run.
    ours = tmp_path / "ours"
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(ours))
    real_build = native_build.build
    evil = tmp_path / "evil.so"
    shutil.copy(kit.planted, evil)

    def build_then_swap(*args):
        built = real_build(*args)  # checked (or built) by build: now swapped under its name
        built.unlink()
        if swap == "link":
            built.symlink_to(evil)
        else:
            shutil.copy(evil, built)
            os.chown(built, NOBODY, NOBODY)
        return built

    monkeypatch.setattr(native_build, "build", build_then_swap)
    lib, status = native_build.load(kit.source, "standin", kit.cxx, _setup)
    assert not marker.exists(), "the library swapped in after the check ran"
    assert lib is None
    want = "is a symbolic link" if swap == "link" else "owned by uid 65534"
    assert status.startswith("UnsafeDirError: ") and want in status, status


def test_kernels_loaded_through_descriptors_stay_distinct(kit, tmp_path, monkeypatch):
    # glibc knows a library by the name it was opened under: a /proc/self/fd/N reused after a
    # close would return the first library for the second, so the descriptors are held.
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(tmp_path / "ours"))
    first = kit.load()
    other = tmp_path / "other.cpp"
    other.write_text(STANDIN.replace("a + b", "a * b"))
    lib, status = native_build.load(other, "standin", kit.cxx, _setup)
    assert lib is not None, status
    assert (first.llmhal_standin_add(2, 3), lib.llmhal_standin_add(2, 3)) == (5, 6)


def _compiles(monkeypatch) -> list[list[str]]:
    """Records the compiler runs that build a library (not ``--version``)."""
    runs: list[list[str]] = []
    real = subprocess.run

    def recording(cmd, *args, **kwargs):
        if "-o" in cmd:
            runs.append(list(cmd))
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", recording)
    return runs


def test_the_users_own_cache_is_used_with_no_rebuild(kit, tmp_path, monkeypatch):
    ours = tmp_path / "ours"
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(ours))
    runs = _compiles(monkeypatch)
    kit.load()
    assert len(runs) == 1
    built = ours / "kernels" / kit.name
    assert stat.S_IMODE(ours.stat().st_mode) == stat.S_IMODE(built.parent.stat().st_mode) == 0o700
    stamp = built.stat().st_mtime_ns
    kit.load()
    assert len(runs) == 1 and built.stat().st_mtime_ns == stamp


def _real_libraries() -> list[native_build.KernelLibrary]:
    from llmhal_cpu import step_graph
    from llmhal_cpu.attention import native
    from llmhal_cpu.kernels import fused_ops, quant_gemm

    return [native.LIBRARY, fused_ops.LIBRARY, quant_gemm.LIBRARY, step_graph.LIBRARY]


def test_the_real_kernels_load_from_a_warm_cache_with_no_compile(kit, monkeypatch):
    # The user's existing cache (built before this rule existed: folders 0755) must keep working.
    libraries = _real_libraries()
    names = {lib.stem: native_build.kernel_name(lib.source, lib.stem, kit.cxx) for lib in libraries}
    cold = [stem for stem, name in names.items() if not (native_build.cache_dir() / name).is_file()]
    if cold:
        pytest.skip(f"not built in {native_build.cache_dir()} yet: {cold} (a slow first build)")
    runs = _compiles(monkeypatch)
    for lib in libraries:
        monkeypatch.setattr(lib, "lib", None)
        monkeypatch.setattr(lib, "status", None)
        if lib.disable_env:
            monkeypatch.delenv(lib.disable_env, raising=False)
        assert lib.get() is not None, lib.status
    assert runs == []


@pytest.mark.slow
@as_root
def test_generate_with_every_real_kernel_planted_runs_none(kit, tmp_path, shared_tmp, marker):
    # The reproduction, end to end: every real kernel planted under its name both in
    # LLMHAL_CACHE_DIR and in the temp fallback. They are all compiled again into a private
    # folder (minutes), and the answer equals the one from the user's own cache.
    names = [native_build.kernel_name(lib.source, lib.stem, kit.cxx) for lib in _real_libraries()]
    attacker = tmp_path / "attacker"
    kit.plant(attacker, names=names)
    kit.plant(shared_tmp / f"llmhal-{os.getuid()}", names=names)
    cmd = [sys.executable, "-m", "llmhal.entrypoints.cli", "generate", "--prompt",
           "The capital of France is", "--no-chat", "--max-tokens", "12", "--temperature", "0"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMHAL_CPU_")}
    env.pop("LLMHAL_CACHE_DIR", None)
    reference = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert reference.returncode == 0, reference.stderr[-2000:]
    env.update(LLMHAL_CACHE_DIR=str(attacker), TMPDIR=str(shared_tmp))
    planted = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert planted.returncode == 0, planted.stderr[-2000:]
    assert not marker.exists(), "a planted kernel's constructor ran"
    assert planted.stdout == reference.stdout and planted.stdout.strip()
    assert planted.stderr.count("Compiling the native CPU kernel") == len(names), planted.stderr

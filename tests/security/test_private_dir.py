"""The rule for cache folders (``llmhal.utils.private_dir``), on folders made in the test."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from llmhal.utils import private_dir


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_missing_levels_are_created_private_and_existing_ones_checked(tmp_path):
    folder = private_dir.ensure(tmp_path / "cache", "kernels")
    assert folder == tmp_path / "cache" / "kernels"
    assert _mode(tmp_path / "cache") == _mode(folder) == 0o700
    (tmp_path / "cache").chmod(0o755)  # readable by others is fine; writable is not
    assert private_dir.ensure(tmp_path / "cache", "kernels") == folder
    folder.chmod(0o775)
    with pytest.raises(private_dir.UnsafeDirError, match=r"kernels is writable by group .*775"):
        private_dir.ensure(tmp_path / "cache", "kernels")
    with pytest.raises(FileNotFoundError):
        private_dir.ensure(tmp_path / "other", "kernels", create=False)
    assert not (tmp_path / "other").exists()


def test_nothing_is_created_inside_a_folder_that_fails(tmp_path):
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(private_dir.UnsafeDirError, match="open is writable by group or others"):
        private_dir.ensure(tmp_path / "open", "kernels")
    assert not (tmp_path / "open" / "kernels").exists()


def test_links_below_the_root_are_never_followed(tmp_path):
    real = private_dir.ensure(tmp_path / "elsewhere")
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache" / "kernels").symlink_to(real)
    with pytest.raises(private_dir.UnsafeDirError, match="kernels is a symbolic link"):
        private_dir.ensure(tmp_path / "cache", "kernels")
    (real / "lib.so").write_bytes(b"")
    (real / "link.so").symlink_to(real / "lib.so")
    assert private_dir.file_problem(real / "lib.so") is None
    assert "symbolic link" in private_dir.file_problem(real / "link.so")
    assert "symbolic link" in private_dir.tree_problem(real)
    with pytest.raises(FileNotFoundError):
        private_dir.file_problem(real / "missing.so")


def test_the_root_may_be_the_users_link_except_in_a_shared_temp_folder(tmp_path):
    real = private_dir.ensure(tmp_path / "scratch-disk")
    (tmp_path / "cache").symlink_to(real)  # LLMHAL_CACHE_DIR pointing at another disk
    assert private_dir.ensure(tmp_path / "cache", "kernels") == tmp_path / "cache" / "kernels"
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "llmhal-0").symlink_to(real)  # anyone could have made it
    with pytest.raises(private_dir.UnsafeDirError, match="symbolic link"):
        private_dir.ensure(shared / "llmhal-0", "kernels")


def test_a_root_below_a_world_writable_folder_without_the_sticky_bit_fails(tmp_path):
    # There anyone can rename the user's cache (or a folder above it) aside and put their own in
    # its place between a check and a read; with the sticky bit (as /tmp) only the owner can.
    open_ = tmp_path / "open"
    mine = private_dir.ensure(open_ / "mine" / "cache")  # made before the folder above opened
    open_.chmod(0o777)
    with pytest.raises(
        private_dir.UnsafeDirError, match=r"open, a folder above it, .*\(mode 777\)"
    ):
        private_dir.ensure(open_ / "mine" / "cache", "kernels")
    (tmp_path / "link").symlink_to(mine)  # reached through a link: the target's folders count
    with pytest.raises(private_dir.UnsafeDirError, match="a folder above it"):
        private_dir.ensure(tmp_path / "link", "kernels")
    open_.chmod(0o1777)
    assert private_dir.ensure(open_ / "mine" / "cache", "kernels").is_dir()


def test_fresh_dir_is_private_per_purpose_and_the_warning_is_given_once(tmp_path, monkeypatch,
                                                                        caplog):  # fmt: skip
    monkeypatch.setattr(private_dir, "_fresh", {})
    monkeypatch.setattr(private_dir, "_warned", set())
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    a = private_dir.fresh_dir("kernels")
    assert a.parent == tmp_path and _mode(a) == 0o700
    assert private_dir.fresh_dir("kernels") == a != private_dir.fresh_dir("grammars")
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        for _ in range(3):
            private_dir.warn_once(tmp_path / "x", "x is owned by uid 1", "Built elsewhere")
    (message,) = [r.getMessage() for r in caplog.records]
    assert "x is owned by uid 1. Built elsewhere." in message and "LLMHAL_CACHE_DIR" in message


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_another_users_folder_fails_and_roots_passes(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(private_dir.UnsafeDirError, match="owned by uid 65534, not by you"):
        private_dir.ensure(theirs)
    assert private_dir.ensure(tmp_path) == tmp_path  # root's (and here: the user's)

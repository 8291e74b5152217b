"""The text each token stands for, as the regex-based backends (outlines, lm-format-enforcer) need
it: xgrammar and llguidance read the HF tokenizer themselves, these two take a vocabulary.

Byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM2, Qwen) write each byte as a printable
stand-in character (``Ġ`` for a space); SentencePiece ones with byte fallback write ``▁`` for a
space and ``<0xNN>`` for a raw byte. Both are turned back into the token's real bytes; any other
tokenizer's tokens go through ``convert_tokens_to_string``. Special tokens (EOS, chat markers)
never stand for text and are left out.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of the fast tokenizer's decoder (a Sequence's members included)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return {p.get("type", "") for p in parts if isinstance(p, dict)}


def special_token_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return ids


def token_bytes(tokenizer: Any, vocab_size: int) -> dict[int, bytes]:
    """Each regular token id below ``vocab_size`` -> the bytes it decodes to (never empty)."""
    kinds = _decoder_kinds(tokenizer)
    special = special_token_ids(tokenizer)
    byte_level = _byte_level_decoder() if "ByteLevel" in kinds else None
    out: dict[int, bytes] = {}
    for token, i in tokenizer.get_vocab().items():
        if i >= vocab_size or i in special:
            continue
        if byte_level is not None and all(c in byte_level for c in token):
            raw = bytes(byte_level[c] for c in token)
        elif (m := _BYTE_TOKEN.fullmatch(token)) is not None:
            raw = bytes([int(m.group(1), 16)])
        elif "ByteFallback" in kinds or "Metaspace" in kinds:
            raw = token.replace("▁", " ").encode()
        else:
            raw = tokenizer.convert_tokens_to_string([token]).encode()
        if raw:
            out[i] = raw
    return out

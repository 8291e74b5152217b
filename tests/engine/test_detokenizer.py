"""Streaming detokenisation across multi-byte characters."""

from __future__ import annotations

from llmhal.engine.detokenizer import IncrementalDetokenizer
from llmhal.testing.tiny_models import make_tokenizer

TEXTS = [
    "Unicode: café, naïve, 東京 😀🚀 Ελληνικά",
    "plain ascii text, numbers 1000 and code()",
    "北京😀x",
]


def test_streamed_text_equals_full_decode_and_never_shows_broken_characters():
    tok = make_tokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        det = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Prompt: "))
        pieces = [det.add([t]) for t in ids]
        pieces.append(det.flush())
        assert "".join(pieces) == tok.decode(ids) == det.text
        assert all("\ufffd" not in p for p in pieces)


def test_byte_split_tokens_are_held_back_until_complete():
    tok = make_tokenizer()
    # An emoji that the tiny vocabulary does not merge: several byte tokens make one character.
    ids = tok.encode("😀")
    if len(ids) < 2:
        return
    det = IncrementalDetokenizer(tok, prompt_token_ids=[])
    assert det.add(ids[:1]) == ""
    rest = "".join(det.add([t]) for t in ids[1:])
    assert rest == "😀"

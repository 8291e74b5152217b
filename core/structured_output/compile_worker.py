"""The structured-output compile process: where outlines-core builds its indexes and interegular
(lm-format-enforcer's regex engine) its automata, away from the engine's interpreter.

On the engine's compile thread both competed for the GIL (interegular is pure Python): beside
them the engine's own Python ran 1.4x (outlines-core) and 1.65x (interegular) slower with pauses
of 0.3-0.6 s, and outlines-core's index took 62 s instead of 12 s (tiny model, a 4-email schema /
a 25-fold email regex, shared 2-core host). Here they have an interpreter of their own. What comes back is data, never
pickle: outlines-core's own binary form of its ``Index`` (read with ``Index.from_binary``) and an
automaton as JSON.

Protocol, over the process's stdin and stdout: each message is a frame, ``<IQ`` (header length,
payload length), a JSON header, then the payload bytes. The parent sends a request and reads the
answer before sending the next; the worker answers every request, ``{"refused": ...}`` when the
library refused the constraint, ``{"error": ...}`` when handling it failed otherwise. It ends when
its stdin closes. This module imports only the standard library until a request needs a library,
so the worker starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from typing import IO, Any

_FRAME = struct.Struct("<IQ")
# Below the engine's priority, not at the bottom: on a 2-core host at load 10, a worker at nice 0
# made the running streams' steps 2.3x slower on average; at 19 a 2 s automaton took 124 s; at
# 10 it took 22 s and the steps kept their pace.
NICENESS = 10


def send(stream: IO[bytes], header: dict[str, Any], payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    stream.write(_FRAME.pack(len(head), len(payload)))
    stream.write(head)
    stream.write(payload)
    stream.flush()


def receive(stream: IO[bytes]) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None at the end of the stream (a frame cut short is an EOFError)."""
    raw = stream.read(_FRAME.size)
    if not raw:
        return None
    if len(raw) < _FRAME.size:
        raise EOFError("the stream ended inside a frame")
    head_len, payload_len = _FRAME.unpack(raw)
    head = stream.read(head_len)
    payload = stream.read(payload_len) if payload_len else b""
    if len(head) < head_len or len(payload) < payload_len:
        raise EOFError("the stream ended inside a frame")
    return json.loads(head), payload


def fsm_to_json(fsm: Any) -> dict[str, Any]:
    """An interegular FSM as JSON data (``None`` stands for its "anything else" symbol)."""
    from interegular.fsm import anything_else

    return {
        "alphabet": [[None if s is anything_else else s, k] for s, k in fsm.alphabet.items()],
        "states": sorted(fsm.states),
        "initial": fsm.initial,
        "finals": sorted(fsm.finals),
        "map": [[s, list(moves.items())] for s, moves in fsm.map.items()],
    }


def fsm_from_json(data: dict[str, Any]) -> Any:
    """:func:`fsm_to_json`'s FSM back (JSON turns integer keys into lists' items, kept as ints)."""
    from interegular.fsm import FSM, Alphabet, anything_else

    alphabet = Alphabet({anything_else if s is None else s: k for s, k in data["alphabet"]})
    moves = {s: dict(map(tuple, m)) for s, m in data["map"]}
    return FSM(alphabet, set(data["states"]), data["initial"], frozenset(data["finals"]), moves, __no_validation__=True)  # fmt: skip


def regex_fsm(pattern: str) -> Any:
    """The automaton lm-format-enforcer's RegexParser builds for ``pattern``."""
    import interegular

    return interegular.parse_pattern(pattern).to_fsm()


class _Worker:
    def __init__(self) -> None:
        self.vocabularies: dict[str, Any] = {}

    def handle(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op = header.get("op")
        if op == "vocabulary":  # sent once per worker and vocabulary, before its first index
            import outlines_core

            self.vocabularies[header["key"]] = outlines_core.Vocabulary.from_binary(payload)
            return {}, b""
        if op == "outlines_index":
            import outlines_core

            vocabulary = self.vocabularies.get(header["key"])
            if vocabulary is None:
                raise KeyError(f"vocabulary {header['key']!r} was never sent")
            try:
                index = outlines_core.Index(header["regex"], vocabulary)
            except (ValueError, TypeError, RuntimeError) as e:
                return {"refused": str(e)}, b""
            return {}, index.__reduce__()[1][0]  # (Index.from_binary, (bytes,)): its own form
        if op == "regex_fsms":
            fsms = []
            for pattern in header["patterns"]:
                try:
                    fsms.append(fsm_to_json(regex_fsm(pattern)))
                except Exception as e:  # interegular's parse errors have no common base
                    return {"refused": f"{pattern!r}: {e}"}, b""
            return {}, json.dumps(fsms).encode()
        raise ValueError(f"unknown request {op!r}")


def main() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, NICENESS)
    except (AttributeError, OSError):
        pass
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a library's print must not land inside a frame
    worker = _Worker()
    while (message := receive(requests)) is not None:
        try:
            header, payload = worker.handle(*message)
        except Exception as e:  # a bug of ours or the library's: the parent fails that request
            header, payload = {"error": f"{type(e).__name__}: {e}"}, b""
        send(answers, header, payload)


if __name__ == "__main__":
    main()

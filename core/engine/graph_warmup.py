"""Record a server's step graphs at start-up, before the first user request needs them.

Under load a server's steps take a few shapes (:mod:`llmhal.engine.decode_graphs`): decode counts
on the padding ladder, each alone or beside one or two prompt chunks of the graph chunk length, or
beside a prompt's last piece (4 or 2 tokens on the CPU) and maybe one chunk.
Recording a shape costs about an eager step, 2-3x its replays; left to the first steps that meet
them, those recordings land in the first busy minute's inter-token tail (a 32-request run at 16
streams met ~12 new shapes). vLLM captures its CUDA graphs at start-up for the same reason.

The steps are run on stand-ins: one request decoding (its last prompt token, repeated for every
decode row, as padding repeats a decode) and one prompt in chunks (likewise repeated). Repeated
rows write the same keys and values to the same slots, the results are dropped, and the stand-ins'
blocks are freed afterwards; nothing a user request sees is touched.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmhal.engine.decode_graphs import _padded_decodes
from llmhal.engine.request import Request, RequestStatus
from llmhal.engine.sampling_params import SamplingParams
from llmhal.engine.scheduler import ScheduledBatch
from llmhal.logger import init_logger

if TYPE_CHECKING:  # pragma: no cover
    from llmhal.engine.llm_engine import LLMEngine

logger = init_logger(__name__)

# Whole prompt chunks a step may hold beside decodes, recorded for each decode count: none, one, two.
MAX_CHUNKS = 2


class _NoText:
    text = ""


def serving_shapes(max_decodes: int, chunk: int) -> list[tuple[int, tuple[int, ...]]]:
    """(decodes, prompt pieces) to record: every decode count of the ladder up to ``max_decodes``
    with 0..MAX_CHUNKS whole chunks of ``chunk`` tokens, and with a prompt's last piece (the powers
    of two from 2 below ``chunk``; a piece of 1 is keyed as a decode) alone or before one chunk,
    the pieces the scheduler gives prompts beside decodes (Scheduler._chunk_len)."""
    counts = sorted({_padded_decodes(d) for d in range(1, max_decodes + 1)})
    tails = [1 << i for i in range(1, max(chunk.bit_length() - 1, 1))]
    pieces = [(chunk,) * k for k in range(MAX_CHUNKS + 1)]
    pieces += [(t,) + rest for t in tails for rest in ((), (chunk,))]
    return [(d, p) for d in counts for p in pieces]


def record_serving_steps(engine: LLMEngine, max_decodes: int) -> int:
    """Record the step graphs of up to ``max_decodes`` decoding streams (see the module text);
    returns how many shapes were recorded (0 where the runner records no mixed steps, or the KV
    cache cannot hold the stand-ins)."""
    graphs = engine.runner.decode_graphs
    if graphs is None or graphs.refused is not None or not graphs.chunk_tokens:
        return 0
    if engine.runner.capture_hidden:
        return 0  # a head drafts from every row's hidden state: such steps run eagerly
    chunk = graphs.chunk_tokens
    token = min(engine.eos_token_ids, default=0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def stand_in(name: str, prompt_len: int) -> Request:
        req = Request(name, None, [token] * prompt_len, params, 1, frozenset(), _NoText())  # type: ignore[arg-type]
        req.status = RequestStatus.RUNNING
        return req

    decoding = stand_in("llmhal-graph-warmup-decode", 2)
    prompt = stand_in("llmhal-graph-warmup-prompt", chunk + 1)
    kv = engine.kv
    if not (kv.allocate(decoding, 2) and kv.allocate(prompt, chunk)):
        kv.free(decoding)
        return 0
    decoding.num_computed_tokens = 1  # its last prompt token is the decode row
    t0, before = time.perf_counter(), graphs.captures
    try:
        with engine.platform.inference_mode():
            for d, pieces in serving_shapes(max_decodes, chunk):
                if any(n in graphs.refused_q for n in pieces):
                    continue  # a length the platform refused to record: it would run eagerly
                items = [(decoding, 1)] * d + [(prompt, n) for n in pieces]
                engine.runner.execute(ScheduledBatch(items))
                if graphs.refused is not None:
                    break
    finally:
        kv.free(decoding)
        kv.free(prompt)
    recorded = graphs.captures - before
    logger.info(
        "Recorded %d serving step shapes (up to %d decodes) in %.1f s.",
        recorded, max_decodes, time.perf_counter() - t0,
    )  # fmt: skip
    return recorded

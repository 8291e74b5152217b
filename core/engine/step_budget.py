"""Decode pace: how many prompt tokens a step may add while other requests are decoding.

A step's time grows with the tokens in it (on a CPU almost in proportion), so a step that
prefills a new prompt's chunk beside the running streams delays every one of their next tokens.
:class:`DecodePace` keeps the engine's own measured costs (never numbers written in for one
machine) and, while requests decode, allows only as many prefill tokens as keep the step's
predicted time within ``factor`` times a decode-only step of the same streams. With nothing
decoding it sets no limit (a lone prompt, an offline batch prefilling at once: the whole step
budget), and it always allows at least ``min_prefill_tokens`` so waiting prompts keep advancing
however slow prefill measures.

The model: a step of ``n`` tokens, decoded and prompt tokens alike (as vLLM's token budget counts
them), takes ``base + per_token * n``, a least-squares line through every step since the warm-up.
The limit needs only its shape, the fixed cost in tokens ``K = base / per_token``: ``d`` decodes
take ``per_token * (K + d)``, so they leave room for ``(factor - 1) * (K + d)`` prompt tokens,
whatever the machine's speed at the moment. Load on a shared machine scales a step's time, not
that shape, so the line keeps every step (a wide spread of sizes, from one stream's decodes to
whole prompts) rather than a moving average of the last few.

This replaced two moving averages (weight 0.1): a line through decode-only steps and the time a
mixed step took beyond it per prompt token. At 16 streams with prompts waiting nearly every step
prefills, so that line was extrapolated from the decode-only steps of lower concurrency and a few
slow steps moved it; measured on the default model at 16 streams (busy machine), it let 104-115
prompt tokens into steps it predicted at 0.8 s (they took 0.26-0.29 s), the slowest gaps of the
run. A step that took more than ``OUTLIER_RATIO`` times the line's prediction (the process was
descheduled, a collection ran) counts as that much.
"""

from __future__ import annotations

# Prompt tokens every step may add while requests decode, whatever the costs say: prefill never
# starves. On a CPU this floor, not the factor, sets the steps at many streams: the default model's
# fixed step cost is ~9 tokens' time, so 1.5 leaves (9 + d) / 2 prompt tokens, under 12 below ~15
# streams, and with prompts always waiting every step prefills exactly this much. A floor of 16
# made those steps ~3.2x a lone stream's decode step (37 against 11.5 ms, noise-free), so the
# target of 3x held only while one stream's p99 was inflated by noise (2.0-3.7x over 9 runs); 12
# makes them ~2.7x at ~8% less throughput at 16 streams, still ~1.2x that at 4 (a simulation of
# the bench over this scheduler with the measured step costs; it reproduced the measured table's
# throughput, time to first token and inter-token p50 within ~5%). Where steps with prompt chunks
# are recorded as graphs (the CPU), the scheduler rounds the allowance down to whole graph chunks,
# so this floor makes one chunk of 8 a step (see llmhal.benchmarks.serve_sim for the trade-off).
MIN_PREFILL_TOKENS = 12
# A step's time is clipped to this many times the line's prediction before it is counted.
OUTLIER_RATIO = 2.0


class DecodePace:
    """The limit on a step's prefill tokens while requests decode (see the module text)."""

    def __init__(self, factor: float, min_prefill_tokens: int = MIN_PREFILL_TOKENS) -> None:
        if factor != 0 and factor <= 1:
            raise ValueError(
                f"decode_pace_factor={factor}: a step with prefill can't be faster than the "
                "decode-only step it extends; give a factor above 1 (e.g. 2), or 0 to turn the "
                "limit off"
            )
        if min_prefill_tokens < 1:
            raise ValueError(f"min_prefill_tokens={min_prefill_tokens}: at least 1, or prefill starves")  # fmt: skip
        self.factor = factor
        self.min_prefill_tokens = min_prefill_tokens
        self.forget()

    def forget(self) -> None:
        """Drop the measured costs (after a warm-up, whose first steps are not typical); until
        new ones come, no limit is set."""
        # Sums over every step: count, x, x*x, y, x*y (x: its tokens, y: its seconds).
        self._n = self._x = self._xx = self._y = self._xy = 0.0

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def line(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token) of the fitted line; None before any step."""
        if self._n == 0:
            return None
        mean_x, mean_y = self._x / self._n, self._y / self._n
        var = self._xx / self._n - mean_x * mean_x
        if var <= 1e-9 * max(1.0, mean_x * mean_x):
            # One step size seen so far: in proportion to it (a CPU step's behaviour).
            return 0.0, mean_y / mean_x
        slope = (self._xy / self._n - mean_x * mean_y) / var
        if slope <= 0:  # noise only (steps of similar sizes): in proportion, as above
            return 0.0, mean_y / mean_x
        return max(0.0, mean_y - slope * mean_x), slope

    def step_seconds(self, tokens: int) -> float | None:
        """Predicted time of a step of ``tokens`` tokens (None: no step seen)."""
        line = self.line()
        return None if line is None else line[0] + line[1] * tokens

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step's measured time; the engine calls this after every step."""
        tokens = prefill_tokens + decode_tokens
        if seconds <= 0 or tokens <= 0:
            return
        predicted = self.step_seconds(tokens)
        if predicted is not None and predicted > 0:
            seconds = min(seconds, OUTLIER_RATIO * predicted)
        self._n += 1
        self._x += tokens
        self._xx += tokens * tokens
        self._y += seconds
        self._xy += tokens * seconds

    def prefill_allowance(self, decode_tokens: int) -> int | None:
        """Prompt tokens a step with ``decode_tokens`` decoding tokens may add; None: no limit
        (off, nothing decoding, or no costs measured yet)."""
        if not self.enabled or decode_tokens <= 0:
            return None
        line = self.line()
        if line is None:
            return None
        base, per_token = line
        fixed_tokens = base / per_token  # K in the module text
        # The small term keeps float rounding (31.9999...) from costing a token.
        spare = (self.factor - 1.0) * (fixed_tokens + decode_tokens)
        return max(self.min_prefill_tokens, int(spare + 1e-6))

"""Decode pace: how many prompt tokens a step may add while other requests are decoding.

A step's time grows with the tokens in it (on a CPU almost in proportion), so a step that
prefills a new prompt's chunk beside the running streams delays every one of their next tokens.
:class:`DecodePace` keeps the engine's own measured costs (exponential moving averages, never
numbers written in for one machine) and, while requests decode, allows only as many prefill
tokens as keep the step's predicted time within ``factor`` times a decode-only step of the same
streams. With nothing decoding it sets no limit (a lone prompt, an offline batch prefilling at
once: the whole step budget), and it always allows at least ``min_prefill_tokens`` so waiting
prompts keep advancing however slow prefill measures.

The model: a decode-only step of ``d`` tokens takes ``base + per_decode * d`` (a weighted
least-squares line through the decode-only steps seen, so a fixed per-step cost is not mistaken
for a per-token one), and each prefill token of a mixed step adds ``per_prefill`` (what such a
step took beyond the decode-only prediction for its decodes, per prefill token).
"""

from __future__ import annotations

# Weight of the newest step in the moving averages: recent enough to follow load changes on a
# shared machine, smooth enough that one slow step does not swing the limit.
EMA_WEIGHT = 0.1
# Prompt tokens every step may add while requests decode, whatever the costs say: prefill never
# starves (a block's worth at the default block size).
MIN_PREFILL_TOKENS = 16


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
        # Exponentially weighted sums over decode-only steps: weight, x, x*x, y, x*y.
        self._w = self._x = self._xx = self._y = self._xy = 0.0
        self.per_prefill: float | None = None  # seconds per prefill token

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def decode_step_seconds(self, decode_tokens: int) -> float | None:
        """Predicted time of a decode-only step of ``decode_tokens`` tokens (None: none seen)."""
        if self._w == 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var <= 1e-9 * max(1.0, mean_x * mean_x):
            # One batch size seen so far: in proportion to it (a CPU step's behaviour).
            return mean_y * decode_tokens / mean_x
        slope = max(0.0, (self._xy / self._w - mean_x * mean_y) / var)
        base = max(0.0, mean_y - slope * mean_x)
        return base + slope * decode_tokens

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step's measured time; the engine calls this after every step."""
        if seconds <= 0 or prefill_tokens + decode_tokens <= 0:
            return
        if prefill_tokens == 0:
            keep = 1.0 - EMA_WEIGHT
            x, y = float(decode_tokens), seconds
            self._w = self._w * keep + EMA_WEIGHT
            self._x = self._x * keep + EMA_WEIGHT * x
            self._xx = self._xx * keep + EMA_WEIGHT * x * x
            self._y = self._y * keep + EMA_WEIGHT * y
            self._xy = self._xy * keep + EMA_WEIGHT * x * y
            return
        # What the step would have taken without its prompt tokens (a step's fixed cost too).
        decode_part = self.decode_step_seconds(decode_tokens)
        if decode_part is None:
            if decode_tokens:
                return  # no decode-only step yet to tell the prefill share of this one
            decode_part = 0.0
        # A step that took less than its decodes should have still says prefill is cheap; the
        # floor keeps the estimate positive.
        sample = max(seconds - decode_part, 0.05 * seconds) / prefill_tokens
        if self.per_prefill is None:
            self.per_prefill = sample
        else:
            self.per_prefill += EMA_WEIGHT * (sample - self.per_prefill)

    def prefill_allowance(self, decode_tokens: int) -> int | None:
        """Prompt tokens a step with ``decode_tokens`` decoding tokens may add; None: no limit
        (off, nothing decoding, or no costs measured yet)."""
        if not self.enabled or decode_tokens <= 0 or self.per_prefill is None:
            return None
        decode = self.decode_step_seconds(decode_tokens)
        if decode is None:
            return None
        spare = (self.factor - 1.0) * decode
        # The small term keeps float rounding (31.9999...) from costing a token.
        return max(self.min_prefill_tokens, int(spare / self.per_prefill + 1e-6))

"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, checked before anything loads.

Unknown keys and impossible values are refused with a ValueError naming the key and the remedy. A
method's own keys are those its proposer class declares in ``config_keys`` (so an out-of-tree
method takes its own settings too); they land in ``extra``. Where ``num_speculative_tokens`` is left
out, a class may derive it from the dict (a classmethod ``num_speculative_tokens_from(raw)``
returning it or None) before ``default_num_speculative_tokens`` applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Keys every method takes (vLLM's names). Those llmhal has no use for yet are accepted only at
# the value that changes nothing (see _NEUTRAL).
COMMON_KEYS = frozenset(
    {
        "method",
        "model",
        "num_speculative_tokens",
        "draft_tensor_parallel_size",
        "disable_by_batch_size",
        "quantization",
        "max_model_len",
        "revision",
        "code_revision",
        "enforce_eager",
        # llmhal's adaptive switch (llmhal.spec_decode.adaptive): a request whose last
        # min_drafts_before_disable drafts were accepted less than this fraction of the time (0:
        # never), or (disable_when_slower) gave fewer tokens per step than a verification step
        # costs in decode steps, stops speculating for retry_after_steps of its steps (0: for good).
        "disable_below_acceptance_rate",
        "disable_when_slower",
        "min_drafts_before_disable",
        "retry_after_steps",
    }
)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "draft_tensor_parallel_size": (None, 1),
    "quantization": (None,),
    "revision": (None,),
    "code_revision": (None,),
}
# vLLM's aliases for model-free methods given as ``model``.
_MODEL_METHODS = {"ngram": "ngram", "[ngram]": "ngram", "suffix": "suffix"}


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    disable_by_batch_size: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    disable_below_acceptance_rate: float = 0.0
    disable_when_slower: bool = False
    min_drafts_before_disable: int = 16
    retry_after_steps: int = 32
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """Check and normalise vLLM's dict shape (see the module docstring)."""
        from llmhal.spec_decode.registry import get_proposer_cls

        if isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(
                f"speculative_config is a dict such as {{'method': 'ngram', "
                f"'num_speculative_tokens': 4}}, got {type(raw).__name__}"
            )
        d = dict(raw)
        method = d.get("method")
        model = d.get("model")
        if method is None and isinstance(model, str) and model.lower() in _MODEL_METHODS:
            method = _MODEL_METHODS[model.lower()]
        if method is None:
            raise ValueError(
                "speculative_config needs 'method' (e.g. 'ngram' or 'suffix'); llmhal does not "
                "guess the method from a draft model"
            )
        if not isinstance(method, str):
            raise ValueError(f"speculative_config['method'] is a str, got {method!r}")
        method = method.lower()
        if isinstance(model, str) and model.lower() in _MODEL_METHODS:
            model = None  # vLLM's model="ngram" is the method, not a checkpoint
        proposer_cls = get_proposer_cls(method)  # ValueError naming the methods there are
        own = frozenset(getattr(proposer_cls, "config_keys", frozenset()))
        unknown = sorted(set(d) - COMMON_KEYS - own)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))} for method "
                f"{method!r}; it takes {', '.join(sorted(COMMON_KEYS | own))}"
            )
        for key, ok in _NEUTRAL.items():
            if d.get(key) not in ok:
                raise ValueError(
                    f"speculative_config[{key!r}]={d[key]!r} is not supported by llmhal; leave it "
                    f"out (allowed: {', '.join(map(repr, ok))})"
                )
        k = d.get("num_speculative_tokens")
        derive = getattr(proposer_cls, "num_speculative_tokens_from", None)
        if k is None and derive is not None:
            k = derive(d)  # a method may derive it from its own keys (EAGLE: its tree's depth)
        if k is None:
            k = getattr(proposer_cls, "default_num_speculative_tokens", None)
        if k is None:
            raise ValueError(
                f"speculative_config needs 'num_speculative_tokens' for method {method!r} (the "
                "draft tokens verified per step, e.g. 4)"
            )
        _positive_int("num_speculative_tokens", k, "use a positive number of draft tokens, e.g. 4")
        if k > MAX_SPEC_LEN:
            raise ValueError(
                f"speculative_config['num_speculative_tokens']={k} is more than {MAX_SPEC_LEN}; "
                "use fewer draft tokens"
            )
        for key in ("disable_by_batch_size", "max_model_len"):
            if d.get(key) is not None:
                _positive_int(key, d[key], "use a positive integer or leave it out")
        if d.get("disable_by_batch_size") is not None and d["disable_by_batch_size"] < 2:
            raise ValueError("speculative_config['disable_by_batch_size'] must be at least 2")
        rate = d.get("disable_below_acceptance_rate", 0.0)
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise ValueError(
                f"speculative_config['disable_below_acceptance_rate']={rate!r} must be a number "
                "in [0, 1] (0: never stop speculating)"
            )
        min_drafts = d.get("min_drafts_before_disable", 16)
        _positive_int("min_drafts_before_disable", min_drafts, "use a positive integer")
        slower = d.get("disable_when_slower", False)
        if not isinstance(slower, bool):
            raise ValueError(
                f"speculative_config['disable_when_slower']={slower!r} must be true or false"
            )
        retry = d.get("retry_after_steps", 32)
        if isinstance(retry, bool) or not isinstance(retry, int) or retry < 0:
            raise ValueError(
                f"speculative_config['retry_after_steps']={retry!r} must be an integer >= 0 (steps "
                "a stopped request decodes before it drafts again; 0: never again)"
            )
        config = cls(
            method=method,
            num_speculative_tokens=k,
            model=model,
            disable_by_batch_size=d.get("disable_by_batch_size"),
            max_model_len=d.get("max_model_len"),
            enforce_eager=d.get("enforce_eager"),
            disable_below_acceptance_rate=float(rate),
            disable_when_slower=slower,
            min_drafts_before_disable=min_drafts,
            retry_after_steps=retry,
            extra={key: d[key] for key in own if key in d},
        )
        proposer_cls.check_config(config)
        return config


# Draft tokens verified per request and step at most (vLLM's MAX_SPEC_LEN).
MAX_SPEC_LEN = 128


def _positive_int(key: str, value: Any, remedy: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"speculative_config[{key!r}]={value!r} must be a positive integer; {remedy}"
        )


def parse_cli_value(text: str) -> dict[str, Any]:
    """``--speculative-config``'s value: JSON text, or ``@file`` holding it."""
    source = "--speculative-config"
    if text.startswith("@"):
        source = text[1:]
        text = Path(source).read_text(encoding="utf-8")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not JSON ({e}); give e.g. '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}'") from None  # fmt: skip
    if not isinstance(value, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(value).__name__}")
    return value

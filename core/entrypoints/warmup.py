"""``llmhal warmup``: do the first run's one-time work now, so the first real command answers in seconds.

It loads the model (by default the default model) on the current platform and generates a few
tokens through the engine, as ``llmhal generate`` would. Whatever a platform builds on first use is
built and cached then: the CPU platform compiles its native kernels for this CPU (about 3 minutes
on 2 busy cores), and the GGUF tokenizer is converted once. Later processes load both from the cache
(``LLMHAL_CACHE_DIR``). ``ci/setup`` runs it; on a warm machine it takes seconds. Core names no
platform here: the engine's own first steps are what triggers each platform's builds.
"""

from __future__ import annotations

import argparse
import sys
import time

from llmhal.entrypoints.engine_args import add_engine_args, build_llm
from llmhal.entrypoints.generate import DEFAULT_PROMPT


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmhal warmup",
        description="Load the model once and generate a few tokens, so that kernels the platform "
        "compiles on first use (and other caches) are built now rather than on the first real run.",
    )
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    print(
        "llmhal warmup: loading the model and generating a few tokens; the first time on a machine "
        "this compiles the platform's kernels (CPU: about 3 minutes on 2 busy cores)",
        file=sys.stderr,
    )
    llm = build_llm("llmhal warmup", args, seed=0)
    if llm is None:
        return 2
    from llmhal.engine.sampling_params import SamplingParams

    tok = llm.get_tokenizer()
    prompt = DEFAULT_PROMPT
    if getattr(tok, "chat_template", None):  # the path `llmhal generate` takes by default
        prompt = llm.apply_chat_template([{"role": "user", "content": DEFAULT_PROMPT}])
    # Two requests of different lengths: prefill, batched decode and single decode steps all run.
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=4)]
    llm.generate([prompt, DEFAULT_PROMPT], params, use_tqdm=False)
    platform = llm.engine.platform.name
    print(
        f"llmhal warmup: ready on the {platform} platform in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Engine-level parity with transformers: greedy tokens and log-probabilities of ``LLM.generate``
against HF ``generate`` on the same tiny checkpoint, prompt by prompt.

Used by the tests of models whose layers keep state (LFM2, MiniMax, Bamba): their state lives in
the engine's caches, so they are compared through :class:`llmhal.LLM`, where batching, chunked
prefill and preemption happen, rather than layer by layer::

    refs = hf_references(hf_model, PROMPTS, 64)
    llm = LLM(folder, dtype="float32", max_num_batched_tokens=8)
    assert not compare_with_references(llm, refs)

:class:`StateModelParity` packages the two standard cases (chunked prefill; unchunked with
preemptions), ``llmhal generate`` and a ``llmhal serve`` stream as pytest tests a test class
inherits, naming the tiny architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

# Prompts of different lengths: one token, a few, and one long enough (29) to cross 16-token
# chunk and block boundaries of the tiny models.
PROMPTS: tuple[tuple[int, ...], ...] = (
    (5, 17, 42),
    (7, 100, 23, 9, 88, 64, 3, 250, 31),
    (300,),
    tuple(range(11, 40)),
)


@dataclass(frozen=True)
class Reference:
    prompt: tuple[int, ...]
    tokens: list[int]
    logprobs: Any  # float32 [steps, vocab]


def hf_references(
    model: Any, prompts: Any, steps: int, *, use_cache: bool = True
) -> list[Reference]:
    """transformers' greedy continuation of each prompt (no EOS stop) and its log-probabilities:
    with ``generate`` (its cache), or (``use_cache=False``) one full forward over the whole
    sequence per step, for configurations whose cached path transformers gets wrong."""
    import torch

    refs = []
    for prompt in prompts:
        with torch.no_grad():
            if use_cache:
                out = model.generate(
                    torch.tensor([list(prompt)]), max_new_tokens=steps, min_new_tokens=steps,
                    do_sample=False, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=0, eos_token_id=None,
                )  # fmt: skip
                scores = torch.stack(out.scores)[:, 0].float()
                tokens = out.sequences[0, len(prompt) :].tolist()
            else:
                seq, rows = list(prompt), []
                for _ in range(steps):
                    rows.append(model(torch.tensor([seq])).logits[0, -1].float())
                    seq.append(int(rows[-1].argmax()))
                scores, tokens = torch.stack(rows), seq[len(prompt) :]
        refs.append(Reference(tuple(prompt), tokens, torch.log_softmax(scores, -1)))
    return refs


def compare_with_references(
    llm: Any, refs: list[Reference], *, atol: float = 2e-4, logprobs: int = 3
) -> list[str]:
    """Run every reference prompt through ``llm`` in one batch (greedy, as many steps as the
    references); returns the differences found (empty: identical tokens, and every returned
    log-probability within ``atol`` of transformers')."""
    from llmhal import SamplingParams

    steps = len(refs[0].tokens)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": list(r.prompt)} for r in refs], params)
    problems = []
    for ref, out in zip(refs, outs, strict=True):
        got = out.outputs[0]
        if got.token_ids != ref.tokens:
            pairs = enumerate(zip(got.token_ids, ref.tokens, strict=False))
            first = next((i for i, (a, b) in pairs if a != b), len(ref.tokens))
            problems.append(
                f"prompt of {len(ref.prompt)} tokens: tokens differ from step {first} "
                f"({got.token_ids[first : first + 4]} != {ref.tokens[first : first + 4]})"
            )
            continue
        for step, entry in enumerate(got.logprobs):
            for tok, lp in entry.items():
                want = float(ref.logprobs[step, tok])
                if abs(lp.logprob - want) > atol:
                    problems.append(
                        f"prompt of {len(ref.prompt)} tokens, step {step}, token {tok}: "
                        f"logprob {lp.logprob:.6f} != {want:.6f}"
                    )
                    break
    return problems


def preempting_budget(llm: Any, slots: int, blocks: int) -> int:
    """A cache budget (``kv_cache_memory_bytes``) that gives ``slots`` state slots (with
    ``max_num_seqs=slots``) and ``blocks`` KV blocks to a model like ``llm``'s: few enough blocks
    that a batch of growing requests must preempt."""
    runner = llm.engine.runner
    per_slot, per_block = runner.state_bytes_per_slot(), runner.kv_cache_bytes_per_block()
    return max(slots * per_slot + blocks * per_block, 2 * slots * per_slot)


def serve_stream_problems(
    llm: Any, model: str, prompt: str = "Paris is", steps: int = 8
) -> list[str]:
    """What differs between ``llmhal serve``'s greedy completion stream on ``llm`` and the
    offline API's answer (empty: more than one event, adding up to the same text). A state
    model's caches must survive the server's engine loop as they do ``LLM.generate``."""
    from llmhal import SamplingParams
    from llmhal.testing.http_client import post_json, running_server

    offline = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=steps))[0]
    body = {"model": model, "prompt": prompt, "max_tokens": steps, "temperature": 0, "stream": True}  # fmt: skip
    with running_server(llm) as (url, _):
        status, events = post_json(f"{url}/v1/completions", body, stream=True)
    if status != 200:
        return [f"status {status}: {events}"]
    streamed = "".join(e["choices"][0]["text"] for e in events)
    problems = [] if len(events) > 1 else [f"one event only: {events}"]
    if streamed != offline.outputs[0].text:
        problems.append(f"streamed {streamed!r} != offline {offline.outputs[0].text!r}")
    return problems


class StateModelParity:
    """Tests inherited by ``class TestX(StateModelParity): arch = "lfm2"`` (an arch of
    :func:`llmhal.testing.tiny_models.make_tiny_model`; needs the session ``tiny_models`` fixture
    of llmhal's tests/conftest.py): ``steps`` greedy steps of :data:`PROMPTS` equal transformers',
    once with 8-token prefill chunks beside decodes, once unchunked with so few KV blocks that
    requests are preempted and recomputed; ``llmhal generate`` on the checkpoint; one short
    ``llmhal serve`` stream. ``chunked_llm`` is left for the class's own tests."""

    arch: ClassVar[str]
    steps: ClassVar[int] = 64
    # A second tiny config turning on what the first leaves at its defaults (biases, groups,
    # scale factors...), checked for 16 steps; ``variant_hf_cache=False`` takes transformers'
    # uncached forward as the reference.
    variant: ClassVar[dict[str, Any]] = {}
    variant_hf_cache: ClassVar[bool] = True
    # Config changes for the slow long-prompt test (e.g. the published 256-token blocks).
    long_overrides: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tiny_models: Any) -> tuple[str, list[Reference]]:
        folder, hf = tiny_models(cls.arch)
        return folder, hf_references(hf, PROMPTS, cls.steps)

    @pytest.fixture(scope="class")
    @classmethod
    def chunked_llm(cls, checkpoint: tuple[str, list[Reference]]) -> Any:
        from llmhal import LLM

        kw = dict(max_num_seqs=4, max_num_batched_tokens=8, enforce_eager=True)
        return LLM(checkpoint[0], dtype="float32", **kw)

    def test_matches_transformers_with_chunked_prefill(self, checkpoint: Any, chunked_llm: Any):
        assert compare_with_references(chunked_llm, checkpoint[1]) == []

    def test_matches_transformers_unchunked_across_preemption(
        self, checkpoint: Any, chunked_llm: Any
    ):
        from llmhal import LLM

        budget = preempting_budget(chunked_llm, slots=4, blocks=7)
        llm = LLM(checkpoint[0], dtype="float32", max_num_seqs=4, kv_cache_memory_bytes=budget)
        assert compare_with_references(llm, checkpoint[1]) == []
        assert llm.engine.stats.preemptions > 0

    def test_config_variant_matches_transformers(self, tiny_models: Any):
        from llmhal import LLM

        if not self.variant:
            pytest.skip(f"{self.arch}: no config variant")
        folder, hf = tiny_models(self.arch, **self.variant)
        refs = hf_references(hf, PROMPTS, 16, use_cache=self.variant_hf_cache)
        kw = dict(max_num_seqs=4, max_num_batched_tokens=8, enforce_eager=True)
        assert compare_with_references(LLM(folder, dtype="float32", **kw), refs) == []

    def test_generate_cli(self, checkpoint: Any, capsys: Any):
        import json

        from llmhal.entrypoints import generate

        args = ["--model", checkpoint[0], "--json", "--max-tokens", "5", "--no-chat",
                "--dtype", "float32", "--prompt", "Paris is"]  # fmt: skip
        assert generate.main(args) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(lines[0]["token_ids"]) == 5

    def test_serve_streams_what_the_offline_api_generates(self, checkpoint: Any, chunked_llm: Any):
        assert serve_stream_problems(chunked_llm, checkpoint[0]) == []

    def test_prompt_logprobs_match_transformers(self, checkpoint: Any, chunked_llm: Any):
        """Every prompt position's log-probability of the next prompt token (prefilled in 8-token
        chunks, so several positions sit at a chunk's edge) against transformers' forward."""
        import torch

        from llmhal import SamplingParams

        hf = self._hf_model(checkpoint)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        prompts = [list(p) for p in PROMPTS if len(p) > 1]
        outs = chunked_llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs, strict=True):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
            got = [e[prompt[i]].logprob for i, e in enumerate(out.prompt_logprobs) if i]
            want = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-4

    def _hf_model(self, checkpoint: Any) -> Any:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(checkpoint[0], dtype="float32").eval()

    @pytest.mark.slow
    def test_long_prompts_in_chunks_match_transformers(self, tiny_models: Any):
        """Prompts of 300 and 517 tokens prefilled 128 tokens a step (so chunks end inside the
        model's blocks or chunks), then 16 greedy steps."""
        from llmhal import LLM

        folder, hf = tiny_models(self.arch, max_position_embeddings=1024, **self.long_overrides)
        prompts = [tuple((7 * i + 3 * j) % 380 + 3 for j in range(n)) for i, n in enumerate((300, 517))]  # fmt: skip
        refs = hf_references(hf, prompts, 16)
        kw = dict(max_num_seqs=2, max_num_batched_tokens=128, enforce_eager=True)
        assert compare_with_references(LLM(folder, dtype="float32", **kw), refs) == []

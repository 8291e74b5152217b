"""--pooler-config and --io-processor-plugin, options of the engine-starting commands (llmhal
serve, generate, warmup)."""

from __future__ import annotations

import argparse

from llmhal.entrypoints.engine_args import add_engine_args, build_llm
from llmhal.pooling import PoolerConfig


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_pooling_options(tiny_models):
    folder, _ = tiny_models("llama")
    llm = build_llm("llmhal serve", _args("--model", folder, "--dtype", "float32", "--max-model-len", "64", "--pooler-config", '{"pooling_type": "mean", "normalize": false}', "--io-processor-plugin", "similarity_ranking"), max_num_seqs=4)  # fmt: skip
    assert llm.engine.pooler_config == PoolerConfig("MEAN", normalize=False)
    assert type(llm.io_processor).__name__ == "SimilarityRanking"


def test_a_bad_pooler_config_is_one_line_before_the_model_loads(capsys):
    assert build_llm("llmhal serve", _args("--model", "/nonexistent", "--pooler-config", '{"pooling_type": "STEP"}')) is None  # fmt: skip
    err = capsys.readouterr().err
    assert (
        "llmhal serve: pooler_config pooling_type='STEP'" in err and "LAST, MEAN, CLS, ALL" in err
    )


def test_an_unknown_io_processor_is_named_before_the_model_loads(capsys):
    assert build_llm("llmhal serve", _args("--model", "/nonexistent", "--io-processor-plugin", "nope")) is None  # fmt: skip
    err = capsys.readouterr().err
    assert "IO processor plugin 'nope' is not installed" in err and "similarity_ranking" in err

"""``llmhal warmup`` (issue 18, item 7): the first run's one-time work, done by ``ci/setup``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from llmhal.entrypoints import warmup
from llmhal.testing.distributions import subprocess_env


def test_warmup_runs_the_engine_and_says_where(tiny_models, capsys):
    folder, _ = tiny_models("llama")
    assert warmup.main(["--model", folder, "--max-model-len", "128"]) == 0
    err = capsys.readouterr().err
    assert "compiles the platform's kernels" in err
    assert "llmhal warmup: ready on the cpu platform in" in err


def test_warmup_reports_a_bad_model_in_one_line(tmp_path, capsys):
    assert warmup.main(["--model", str(tmp_path / "missing")]) == 2
    assert "llmhal warmup:" in capsys.readouterr().err


@pytest.mark.slow
def test_after_warmup_the_first_generate_compiles_nothing(tmp_path):
    """On an empty kernel cache, warmup compiles the CPU kernels; generate then reuses them."""
    env = subprocess_env(env={"LLMHAL_CACHE_DIR": str(tmp_path / "cache")})
    llmhal = [sys.executable, "-m", "llmhal.entrypoints.cli"]
    proc = subprocess.run(
        [*llmhal, "warmup"], env=env, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One progress line per kernel, saying it happens once and that warmup does it ahead.
    assert proc.stderr.count("Compiling the native CPU kernel") >= 3
    assert "first use only" in proc.stderr and "`llmhal warmup` builds every kernel" in proc.stderr
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "cache" / "kernels").glob("*.so"))
    assert {"fused_ops", "paged_attention", "quant_gemm"} <= set(built), built
    proc = subprocess.run(
        [*llmhal, "generate", "--prompt", "What is the capital of France?", "--max-tokens", "8"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Compiling" not in proc.stderr
    assert "Paris" in proc.stdout
    assert os.listdir(tmp_path / "cache" / "kernels")

"""An out-of-tree proposer, registered by a general plugin of a separately installed
distribution, runs through the engine (and through ``llmhal generate --speculative-config``)."""

from __future__ import annotations

import json

import pytest

from llmhal.testing.distributions import FakeDistribution, build_distributions, run_cli, run_python

PROPOSER = '''
from llmhal.spec_decode import Proposer


class EchoProposer(Proposer):
    """Drafts the last token again, ``echo_times`` times (its own config key)."""

    config_keys = frozenset({"echo_times"})

    def propose(self, requests):
        k = self.config.extra.get("echo_times", 2)
        return [[r.output_token_ids[-1]] * min(k, r.max_draft) for r in requests]


def register():
    from llmhal.spec_decode import register_proposer

    register_proposer("echo", "myspec_pkg:EchoProposer")
'''


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory):
    dist = FakeDistribution(
        "myspec",
        "1.0",
        entry_points={"vllm.general_plugins": {"myspec": "myspec_pkg:register"}},
        modules={"myspec_pkg.py": PROPOSER},
    )
    return build_distributions(tmp_path_factory.mktemp("dists"), dist)


def test_a_plugins_proposer_runs(plugin_root, tiny_folder):
    root = plugin_root
    code = f"""
    import json
    from llmhal import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = {{"prompt_token_ids": [5, 6, 7, 7, 7]}}
    spec = {{"method": "echo", "num_speculative_tokens": 3, "echo_times": 3}}
    plain = LLM({tiny_folder!r}, dtype="float32", max_model_len=128).generate(prompt, params)
    llm = LLM({tiny_folder!r}, dtype="float32", max_model_len=128, speculative_config=spec)
    out = llm.generate(prompt, params)
    stats = llm.engine.speculator.stats
    print(json.dumps({{"same": out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids,
                       "drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens,
                       "proposer": type(llm.engine.speculator.proposer).__name__}}))
    """
    proc = run_python(code, path=[root], timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["proposer"] == "EchoProposer"
    assert got["same"] and got["drafts"] > 0 and got["draft_tokens"] > 2 * got["drafts"]


@pytest.mark.slow
def test_a_plugins_proposer_through_the_cli(plugin_root, tiny_folder):
    """Its own key is read, and a key the method does not declare is refused."""
    root = plugin_root
    cli = run_cli(
        "generate", "--model", tiny_folder, "--no-chat", "--prompt", "abc", "--max-tokens", "8",
        "--json", "--speculative-config", '{"method": "echo", "num_speculative_tokens": 2, "echo_times": 1}',
        path=[root], timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    summary = json.loads(cli.stdout.strip().splitlines()[-1])["summary"]
    assert summary["spec_decode"]["num_drafts"] > 0
    bad = run_cli(
        "generate",
        "--model",
        tiny_folder,
        "--speculative-config",
        '{"method": "echo", "echo_timez": 2}',  # fmt: skip
        path=[root],
        timeout=300,
    )
    assert bad.returncode == 2 and "'echo_timez'" in bad.stderr and "echo_times" in bad.stderr

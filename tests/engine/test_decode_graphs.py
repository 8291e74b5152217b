"""Decode-step graphs (``llmhal.engine.decode_graphs``): replayed steps give exactly the eager
engine's tokens and log-probabilities, through batch-size changes and preemption; steps a platform
cannot record run eagerly, with the reason kept; ``enforce_eager`` turns graphs off."""

from __future__ import annotations

import pytest

from llmhal import LLM, SamplingParams
from llmhal.platforms import Platform, get_current_platform

# Lengths and budgets chosen so the batch shrinks 3 -> 2 -> 1 (a graph per size) and, with the
# small cache, requests are preempted and recomputed mid-generation.
PROMPTS = [list(range(100, 105)), list(range(300, 337)), list(range(700, 719))]
MAX_TOKENS = [40, 9, 24]


def _run(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[dict]]]:
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in MAX_TOKENS
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module")
def default_model_path():
    from llmhal.default_model import default_model_path

    try:
        return str(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _auto_dtype_bytes() -> int:
    """Bytes of the dtype the default (GGUF) model runs in here: bfloat16 on a host with fast
    bf16 matmuls, else float32; its KV cache holds that dtype."""
    from types import SimpleNamespace

    from llmhal.engine.builder import resolve_dtype

    return resolve_dtype("auto", SimpleNamespace(), get_current_platform(), is_gguf=True).itemsize


@pytest.mark.parametrize("kv_blocks", [None, 5], ids=["roomy", "preempting"])
def test_replayed_decode_equals_eager_on_the_default_model(default_model_path, kv_blocks):
    # 5 blocks of 16 tokens for SmolLM2's 30 layers of 3 KV heads of 64 (keys and values).
    kv_bytes = kv_blocks and kv_blocks * 16 * 30 * 2 * 3 * 64 * _auto_dtype_bytes()
    kw = {"max_num_seqs": 4, "kv_cache_memory_bytes": kv_bytes or (64 << 20)}
    graphs = LLM(default_model_path, **kw)
    got = _run(graphs)
    dg = graphs.engine.runner.decode_graphs
    if dg is None or dg.refused is not None:
        pytest.skip(f"this host records no decode graphs ({dg and dg.refused})")
    assert dg.replays > 0
    assert {len(qs) for qs in dg.recorded_shapes()} >= {1, 2}  # batch sizes recorded
    # The graphs share one pool: about a layer's buffers at the largest batch, not a step's each.
    assert 0 < dg.pool.nbytes < 1 << 20
    eager = LLM(default_model_path, enforce_eager=True, **kw)
    assert eager.engine.runner.decode_graphs is None
    want = _run(eager)
    assert got == want  # bit for bit: the same kernels on the same values
    if kv_bytes:
        assert graphs.engine.stats.preemptions > 0


def test_unrecordable_steps_run_eagerly_and_say_why(tiny_models):
    folder, _ = tiny_models("llama")
    llm = LLM(folder, kv_cache_memory_bytes=4 << 20)
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4)
    )
    assert len(out[0].outputs[0].token_ids) == 4
    dg = llm.engine.runner.decode_graphs
    if get_current_platform().capabilities.graphs:
        # An unquantized model's matmuls are torch's: the recorder names the op it cannot replay.
        assert dg is not None and dg.refused is not None and "torch's" in dg.refused
        assert dg.replays == 0
    else:
        assert dg is None


def test_the_default_platform_records_nothing():
    class NoGraphs(Platform):
        name = "nographs"

    result, graph, reason = NoGraphs().capture_step_graph(lambda: 42)
    assert (result, graph) == (42, None) and "nographs" in reason


def test_qwen3_per_head_norms_are_recorded_too(tmp_path):
    """A quantized Qwen3 (q/k norms on per-head views of the fused projection) replays its decode
    steps and matches its eager run exactly."""
    from llmhal.testing.quant_models import PROMPTS as TINY_PROMPTS
    from llmhal.testing.quant_models import awq_rtn, write_pair
    from llmhal.testing.tiny_models import make_tiny_model

    base = tmp_path / "base"
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
    make_tiny_model(base, "qwen3", **shape)
    qcfg = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
            "version": "gemm"}  # fmt: skip
    quant, _ = write_pair(tmp_path, lambda name, w: awq_rtn(w, 64), qcfg, base=base)
    kw = {"kv_cache_memory_bytes": 4 << 20, "max_num_seqs": 4}
    _check_replays_equal_eager(str(quant), TINY_PROMPTS, kw)


def _check_replays_equal_eager(model: str, prompts: list[list[int]], kw: dict) -> set[int]:
    """``model`` records every decode step and its outputs equal its eager run's (skips where the
    platform records nothing); returns the batch sizes recorded."""
    graphs = LLM(model, **kw)
    got = _run(graphs, prompts)
    dg = graphs.engine.runner.decode_graphs
    if dg is None or not get_current_platform().capabilities.graphs:
        pytest.skip("this platform records no decode graphs")
    assert dg.refused is None and dg.replays > 0
    assert got == _run(LLM(model, enforce_eager=True, **kw), prompts)
    return {len(qs) for qs in dg.recorded_shapes()}


def test_a_quantized_mamba2_replays_its_decodes_with_the_state_slots(tiny_models, tmp_path):
    """Recurrent layers record too: each request's state slot is a static buffer of the graph, and
    a one-token first step zeroes its slot before the replay. A Q8_0 GGUF Mamba-2 (every matmul a
    native kernel) replays its decodes through batch-size changes and equals its eager run."""
    from tests.models.test_gguf_ssm import write_ssm_gguf

    folder, hf = tiny_models("mamba2", tie_word_embeddings=False)
    path = tmp_path / "q8.gguf"
    write_ssm_gguf(hf, path, "Q8_0")
    prompts = [list(range(5, 9)), [7], list(range(20, 33))]
    kw = {"tokenizer": folder, "kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 4}
    assert _check_replays_equal_eager(str(path), prompts, kw) >= {1, 2}


def test_mixed_steps_are_recorded_padded_and_equal_eager(default_model_path):
    """Prompts admitted while others decode prefill in graph chunks beside them: those mixed steps
    are recorded too (keyed by their query lengths, decode counts padded up the ladder by
    repeating the last decode), and every token and log-probability equals the eager run's,
    which schedules the same steps."""
    from llmhal.engine.decode_graphs import _padded_decodes

    if not get_current_platform().capabilities.graph_chunk_tokens:
        pytest.skip("this platform records no mixed steps")
    # Seven requests through five slots: the later ones prefill beside 4-5 decoding streams.
    prompts = [list(range(100 + 40 * i, 109 + 40 * i + 3 * i)) for i in range(7)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=2) for i in range(7)]  # fmt: skip
    kw = {"max_num_seqs": 5, "kv_cache_memory_bytes": 64 << 20}

    def run(llm: LLM) -> list:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    def paced(llm: LLM) -> LLM:
        # Chunks are capped beside decodes only under the pace (a server's setting). A factor
        # just above 1 leaves the floor's one chunk a step whatever the measured costs, so the
        # eager and the recorded run schedule the same steps.
        llm.engine.set_decode_pace(1.01)
        return llm

    graphs = paced(LLM(default_model_path, **kw))
    got = run(graphs)
    dg = graphs.engine.runner.decode_graphs
    if dg is None or dg.refused is not None:
        pytest.skip(f"this host records no decode graphs ({dg and dg.refused})")
    shapes = dg.recorded_shapes()
    mixed = [qs for qs in shapes if 1 in qs and max(qs) > 1]
    assert mixed, shapes
    for qs in shapes:  # decode counts on the ladder, chunks of 8 or powers of two
        decodes = qs.count(1)
        assert decodes == _padded_decodes(decodes) or max(qs) == 1
        assert all(q in (1, 2, 4, 8) for q in qs)
    assert any(qs.count(1) == 6 for qs in shapes)  # 5 decodes padded to 6
    eager = paced(LLM(default_model_path, enforce_eager=True, **kw))
    assert got == run(eager)
    # A server records its shapes at start-up on stand-in requests (llmhal.engine.graph_warmup):
    # every ladder count up to the limit with 0-2 chunks or a last piece, blocks all returned,
    # outputs unchanged.
    from llmhal.engine.graph_warmup import record_serving_steps, serving_shapes

    kv = graphs.engine.kv
    recorded = record_serving_steps(graphs.engine, 8)
    assert kv.num_free_blocks == kv.num_blocks
    expected = {(1,) * d + pieces for d, pieces in serving_shapes(8, 8)}
    assert expected <= set(dg.recorded_shapes())
    assert recorded == len(expected - set(shapes))  # the ones not met before
    assert run(graphs) == run(eager)  # second runs: both find the prompts' prefixes cached


def test_the_decode_ladder():
    from llmhal.engine.decode_graphs import _padded_decodes

    assert [_padded_decodes(d) for d in range(0, 18)] == [0, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16, 16, 16, 16, 24]  # fmt: skip

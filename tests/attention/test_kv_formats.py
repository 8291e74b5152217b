"""KV-cache formats int8 and nvfp4 (llmhal.attention.kv_formats): the stored rows, their error
bounds, the cache sizes against the formula, and the engine's output against the unquantized cache
on tiny random models (a Llama and a DeepSeek latent cache).

Tolerances (measured on these models, 16 greedy steps, 4 prompts, float32 compute; see
docs/quantization.md): teacher-forced |log-probability difference| against the model-dtype cache,
int8 max 0.035 mean 0.009 (asserted: 0.1 / 0.03), nvfp4 max 1.08 mean 0.24 (asserted: 2.0 / 0.5);
greedy tokens equal until a step where the unquantized run's top two were within 0.05 (int8) or
0.5 (nvfp4) of each other. The tiny random models' next-token distributions are nearly flat, so
these bound the cache's rounding, not a real model's quality (the slow default-model test does).
"""

from __future__ import annotations

import json

import pytest
import torch

from llmhal.attention import kv_formats, paged_kv
from llmhal.attention.backend import AttentionRequirements
from llmhal.attention.kv_formats import INT8, NVFP4, kv_bytes_per_token
from llmhal.attention.mla.common import LatentKVLayout
from llmhal.attention.reference import ReferenceAttentionBackend
from llmhal.testing.kv_accuracy import compare_kv_formats, save_tiny_mla

ONE = torch.tensor(1.0)
PROMPTS = [[5, 17, 42], [7, 100, 23, 9, 88, 64, 3, 250, 31], [300], list(range(11, 29))]


# ------------------------------------------------------------------------------ stored rows
def test_int8_rows_hold_values_then_their_float32_scale_and_round_to_half_a_step():
    x = torch.randn(7, 3, 40, generator=torch.Generator().manual_seed(0)) * 5
    rows = INT8.encode(x, ONE)
    assert rows.dtype == torch.int8 and rows.shape == (7, 3, 44)
    scale = rows[..., 40:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    err = (INT8.decode(rows, ONE, torch.float32) - x).abs()
    assert bool((err <= scale / 2 * (1 + 1e-5)).all())
    # The row's largest value is stored exactly (as +-127 times its scale).
    assert set(rows[..., :40].abs().amax(-1).flatten().tolist()) == {127}


def test_nvfp4_packs_two_codes_a_byte_low_nibble_first_then_e4m3_block_scales():
    x = torch.tensor([0.5, -6.0] + [0.0] * 14 + [3.0] * 16)  # two blocks; the first has amax 6
    rows = NVFP4.encode(x, ONE)
    assert rows.dtype == torch.uint8 and rows.shape == (16 + 2,)
    # 0.5 is code 1, -6 is sign 8 | code 7: one byte 0xF1. 3 is code 5 over its block's scale 0.5.
    assert int(rows[0]) == 0xF1 and int(rows[8]) == 0x77
    scales = rows[16:].view(torch.float8_e4m3fn).float()
    # With the layer scale 1 (NVFP4's global scale 1/6), a block scale is the block's max|x|.
    assert scales.tolist() == [6.0, 3.0]
    assert torch.equal(NVFP4.decode(rows, ONE, torch.float32), x)


def test_nvfp4_rounds_to_the_nearest_e2m1_value_ties_to_even():
    # One block with amax 6 (block scale 6, a step of 1): each value sits between two codes.
    got = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.3, -2.6, 5.1] + [0.0] * 5)
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -3.0, 6.0] + [0.0] * 5)
    assert torch.equal(NVFP4.decode(NVFP4.encode(got, ONE), ONE, torch.float32), want)


def test_nvfp4_error_is_within_half_the_widest_gap_of_each_block_and_follows_the_layer_scale():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 64, generator=gen) * torch.logspace(-2, 2, 64)
    got = []
    for scale in (torch.tensor(1.0), torch.tensor(0.01)):
        xs = x * scale  # the layer scale sets the range: values in units of it
        back = NVFP4.decode(NVFP4.encode(xs, scale), scale, torch.float32)
        blocks = xs.view(5, 2, 4, 16)
        step = blocks.abs().amax(-1, keepdim=True) / 6  # the block's unit; codes are <= 2 apart
        err = (back.view(5, 2, 4, 16) - blocks).abs()
        # e4m3 rounds the block scale by up to 1/16: a little more than one unit at worst.
        assert bool((err <= step * 1.07).all())
        got.append(back / scale)
    torch.testing.assert_close(got[0], got[1])
    # Beyond 448 x the layer scale a block saturates, as fp8 e4m3 does under the same scale.
    big = torch.full((16,), 1000.0)
    assert float(NVFP4.decode(NVFP4.encode(big, ONE), ONE, torch.float32).max()) == pytest.approx(
        448
    )


def test_all_zero_rows_read_back_as_zeros():
    z = torch.zeros(3, 32)
    for fmt in (INT8, NVFP4):
        assert torch.equal(fmt.decode(fmt.encode(z, ONE), ONE, torch.float32), z)


def test_the_shared_helpers_write_and_read_packed_rows_at_their_slots():
    gen = torch.Generator().manual_seed(2)
    for name in ("int8", "nvfp4"):
        shape = ReferenceAttentionBackend.get_kv_cache_shape(4, 8, 2, 32, name)
        assert shape == (2, 4, 8, 2, kv_formats.row_size(name, 32))
        cache = torch.zeros(
            shape, dtype=ReferenceAttentionBackend.kv_cache_torch_dtype(torch.float32, name)
        )
        key, value = torch.randn(2, 5, 2, 32, generator=gen)
        slots = torch.tensor([3, 17, -1, 30, 9])
        paged_kv.write_kv(cache, key, value, slots, ONE, ONE)
        k, v = paged_kv.read_kv(cache, torch.tensor([[3, 17], [30, 9]]), ONE, ONE)
        fmt = kv_formats.packed_format(name)
        want_k = fmt.decode(fmt.encode(key[[0, 1, 3, 4]], ONE), ONE, torch.float32)
        assert k.shape == (2, 2, 2, 32) and torch.equal(k.reshape(4, 2, 32), want_k)
        assert v.shape == k.shape


# ------------------------------------------------------------------------- sizes and choices
@pytest.mark.parametrize(
    ("name", "dtype", "row_bytes"),
    [("auto", torch.float32, 256), ("auto", torch.bfloat16, 128), ("fp8_e4m3", torch.bfloat16, 64),
     ("int8", torch.bfloat16, 68), ("nvfp4", torch.bfloat16, 36)],
)  # fmt: skip
def test_bytes_per_token_formula_for_mha_and_mla(name, dtype, row_bytes):
    from transformers import DeepseekV3Config, LlamaConfig

    llama = LlamaConfig(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576
    )
    assert kv_formats.row_bytes(name, 64, dtype) == row_bytes
    assert kv_bytes_per_token(llama, name, dtype).bytes == 2 * 30 * 3 * row_bytes
    # DeepSeek-V3: (kv_lora_rank + qk_rope_head_dim) x layers x the element size, one latent row.
    ds = DeepseekV3Config(num_hidden_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)
    latent_row = kv_formats.row_bytes(name, 576, dtype)
    assert kv_bytes_per_token(ds, name, dtype).bytes == 61 * latent_row
    if name == "auto" and dtype == torch.bfloat16:
        assert latent_row == 576 * 2
    assert LatentKVLayout.get_kv_cache_shape(3, 16, 1, 576, name)[-1] == kv_formats.row_size(
        name, 576
    )


def test_names_aliases_and_head_size_rules():
    assert kv_formats.canonical_kv_cache_dtype("fp8") == "fp8_e4m3"
    assert kv_formats.canonical_kv_cache_dtype("int8_per_token_head") == "int8"
    with pytest.raises(ValueError, match="is not one of auto, fp8_e4m3, fp8_e5m2, int8, nvfp4"):
        kv_formats.canonical_kv_cache_dtype("fp4")
    req = AttentionRequirements(
        head_size=80, num_heads=4, num_kv_heads=2, dtype=torch.float32, kv_cache_dtype="nvfp4"
    )
    assert ReferenceAttentionBackend.validate(req) == []
    odd = ReferenceAttentionBackend.validate(
        AttentionRequirements(**{**req.__dict__, "head_size": 72})
    )
    assert odd == [
        "kv_cache_dtype nvfp4 needs head_size to be a multiple of 16 (its block-scale group), not 72"
    ]


# ----------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def llama(tiny_models):
    return tiny_models("llama")[0]


@pytest.fixture(scope="module")
def llama_accuracy(llama):
    return compare_kv_formats(
        llama, PROMPTS, ["fp8_e4m3", "int8", "nvfp4"], 16, dtype="float32",
        kv_cache_memory_bytes=1 << 22,
    )  # fmt: skip


def test_quantized_caches_stay_close_to_the_unquantized_one(llama_accuracy):
    acc = llama_accuracy
    int8, nvfp4, fp8 = acc["int8"], acc["nvfp4"], acc["fp8_e4m3"]
    assert int8.max_logprob_diff <= 0.1 and int8.mean_logprob_diff <= 0.03, int8.summary()
    assert nvfp4.max_logprob_diff <= 2.0 and nvfp4.mean_logprob_diff <= 0.5, nvfp4.summary()
    # 7 mantissa-like bits beat e4m3's 3, which beat e2m1's 1.
    assert int8.mean_logprob_diff < fp8.mean_logprob_diff < nvfp4.mean_logprob_diff
    # Greedy tokens part only where the unquantized run's top two were nearly tied.
    assert sum(n == 16 for n in int8.agreement) >= 3, int8.summary()
    assert all(g <= 0.05 for g in int8.gaps_at_divergence), int8.summary()
    assert all(g <= 0.5 for g in nvfp4.gaps_at_divergence), nvfp4.summary()


def test_the_load_report_gives_bytes_per_token_by_the_formula(llama, llama_accuracy):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(llama)
    # 2 layers x 2 KV heads x 16 values, K and V: rows of 64 B (fp32), 16 (fp8), 20 (int8), 9 (nvfp4).
    want = {"auto": 512, "fp8_e4m3": 128, "int8": 160, "nvfp4": 72}
    for name, acc in llama_accuracy.items():
        assert acc.kv_cache_bytes_per_token == want[name]
        assert kv_bytes_per_token(cfg, name, torch.float32).bytes == want[name]


def test_prefix_caching_and_preemption_change_no_output(llama):
    """nvfp4 (int8 rows go through the same helpers): a cached block holds what recomputing the
    prefix would store, so reusing it, or recomputing after preemption, changes nothing."""
    from llmhal import LLM, SamplingParams

    name = "nvfp4"

    system = [5, 17, 3, 99, 42, 7, 7, 64, 12, 5, 88, 31, 2, 19, 50, 6, 6, 73, 21, 9, 11, 13, 40, 41]
    prompts = [{"prompt_token_ids": system + tail} for tail in ([60, 61, 62], [70], [80, 81, 82])]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run(**kw):
        llm = LLM(llama, dtype="float32", block_size=4, kv_cache_dtype=name, **kw)
        return llm, llm.generate(prompts, params, use_tqdm=False)

    _, off = run(enable_prefix_caching=False)
    llm, first = run()
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [24, 24, 24]
    for a, b in zip(off, again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for got, want in zip(b.outputs[0].logprobs, a.outputs[0].logprobs, strict=True):
            for t in want:
                assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)
    # 10 blocks of 4 tokens cannot hold the three requests (up to 39 tokens each) at once.
    block = llm.engine.runner.kv_cache_bytes_per_block()
    small, outs = run(kv_cache_memory_bytes=10 * block)
    assert small.engine.stats.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in off]


def test_a_backend_without_the_format_is_refused_naming_those_it_has(llama):
    from llmhal import LLM
    from llmhal.attention.selector import AttentionBackendError

    with pytest.raises(AttentionBackendError) as e:
        LLM(llama, dtype="float32", kv_cache_dtype="nvfp4", attention_backend="flex_attention")
    assert "kv_cache_dtype nvfp4 not supported (supported: auto)" in str(e.value)
    assert "cpu_attn" in str(e.value)  # among the backends that do work here


# ------------------------------------------------------------------------ MLA latent cache
@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return save_tiny_mla(tmp_path_factory.mktemp("deepseek_kv"))


def test_the_mla_latent_cache_in_int8_and_nvfp4(deepseek):
    folder, cfg = deepseek
    acc = compare_kv_formats(
        folder, PROMPTS, ["int8", "nvfp4"], 8, dtype="float32", kv_cache_memory_bytes=1 << 20
    )
    # One latent row of 32 + 16 values a layer, 3 layers: 192 B (fp32), 52 (int8), 27 (nvfp4).
    for name, per_row in (("auto", 48 * 4), ("int8", 52), ("nvfp4", 27)):
        assert acc[name].kv_cache_bytes_per_token == 3 * per_row
        assert kv_bytes_per_token(cfg, name, torch.float32).bytes == 3 * per_row
    assert acc["int8"].max_logprob_diff <= 0.1, acc["int8"].summary()
    assert acc["nvfp4"].max_logprob_diff <= 2.0, acc["nvfp4"].summary()
    assert acc["int8"].mean_logprob_diff < acc["nvfp4"].mean_logprob_diff


@pytest.mark.parametrize("name", ["int8", "nvfp4"])
def test_tree_attention_reads_packed_rows_like_the_reference(name):
    """tree_attn (speculative draft trees) reads the cache through the shared helpers too."""
    from dataclasses import replace

    from llmhal.attention.tree_attn import TreeAttentionBackend
    from llmhal.testing.attention_conformance import check_attention_case, conformance_cases

    for case in conformance_cases(TreeAttentionBackend)[:3]:
        check_attention_case(TreeAttentionBackend, replace(case, kv_cache_dtype=name))


def test_generate_reports_the_format_and_its_bytes_per_token(llama, capsys):
    from llmhal.entrypoints import generate

    args = ["--model", llama, "--json", "--max-tokens", "3", "--no-chat", "--prompt", "hi"]
    assert generate.main([*args, "--kv-cache-dtype", "fp8", "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    # vLLM's "fp8" is e4m3: 2 layers x 2 KV heads x 16 values x 1 byte, K and V.
    assert (summary["kv_cache_dtype"], summary["kv_cache_bytes_per_token"]) == ("fp8_e4m3", 128)


@pytest.mark.parametrize("name", ["int8", "nvfp4"])
def test_the_attention_bench_fills_and_times_a_packed_cache(tmp_path, capsys, name):
    from llmhal.benchmarks import attention

    out = tmp_path / "attention.json"
    argv = ["--backends", "cpu_attn", "--modes", "decode", "--dtypes", "float32", "--batch", "2",
            "--context", "40", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "16",
            "--repeats", "1", "--warmup", "1", "--flush-mb", "1", "--kv-cache-dtype", name,
            "--json", str(out)]  # fmt: skip
    assert attention.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # Against SDPA on the unquantized keys: within the format's rounding, not exact.
    assert row["ms"] > 0 and 0 < row["max_abs_diff"] < (0.05 if name == "int8" else 0.5), row

"""The hardware-neutral helpers backends share: step checks, platform reasons, window conventions,
the paged-KV gathers of :mod:`llmhal.attention.paged_kv` and the window rule of the reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmhal.attention import paged_kv
from llmhal.attention.batch import build_common_metadata
from llmhal.attention.paged_kv import kv_token_slots
from llmhal.attention.reference import causal_window_mask, first_visible_position
from llmhal.attention.utils import (
    check_causal,
    check_step,
    flash_window_size,
    platform_mismatch,
    require_model_dtype_cache,
)
from llmhal.platforms import Platform, UnspecifiedPlatform


def test_step_checks_refuse_what_a_backend_does_not_define():
    common = build_common_metadata([1, 3], [4, 0], [[0], [1]], 16)
    check_step(common, "mine")  # a plain causal step passes
    with pytest.raises(ValueError, match="^mine implements causal \\(decoder\\) attention only"):
        check_causal(replace(common, causal=False), "mine")
    with pytest.raises(ValueError, match="^mine cannot verify draft trees .*tree_attn backend"):
        check_step(replace(common, tree_mask=torch.ones(3, 3, dtype=torch.bool)), "mine")
    check_causal(replace(common, tree_mask=torch.ones(3, 3, dtype=torch.bool)), "mine")


def test_platform_mismatch_names_both_platforms():
    class _Npu(Platform):
        name = "npu"

    assert platform_mismatch(_Npu(), _Npu) == []
    assert platform_mismatch(UnspecifiedPlatform(), _Npu) == [
        "needs the npu platform (this is the unspecified platform)"
    ]


def test_model_dtype_cache_rule():
    require_model_dtype_cache("auto", "mine", "another backend")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e5m2' needs another backend"):
        require_model_dtype_cache("fp8_e5m2", "mine", "another backend")


def test_flash_window_size_matches_the_masking_semantics():
    assert flash_window_size(None) == (-1, -1)
    assert flash_window_size(0) == (-1, -1)
    # W = 4: a query at p sees p-3..p, i.e. three keys to its left and none to its right.
    assert flash_window_size(4) == (3, 0)


def test_kv_token_slots_match_the_engine_slots():
    tables = [[5, 2], [7], [0, 3, 6]]
    common = build_common_metadata([1, 4, 9], [20, 3, 30], tables, 16)
    slots, cu = kv_token_slots(common.block_table, common.seq_lens_cpu, 16)
    assert cu.tolist() == [0, 21, 28, 67]
    expected = build_common_metadata([21, 7, 39], [0, 0, 0], tables, 16).slot_mapping
    assert slots.tolist() == expected.tolist()


def test_gather_and_read_agree_with_written_tokens():
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(paged_kv.kv_cache_shape(4, 8, 2, 16))
    slots = torch.tensor([3, 17, 30, -1, 9])
    key, value = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    one = torch.tensor(1.0)
    paged_kv.write_kv(cache, key, value, slots, one, one)
    k, v = paged_kv.gather_kv(cache, slots[[0, 1, 2, 4]])
    assert torch.equal(k, key[[0, 1, 2, 4]]) and torch.equal(v, value[[0, 1, 2, 4]])
    rk, rv = paged_kv.read_kv(cache, torch.tensor([[3, 17], [30, 9]]), one, one)
    assert rk.shape == (2, 2, 2, 16) and torch.equal(rk.reshape(4, 2, 16), k)
    assert torch.equal(rv.reshape(4, 2, 16), v)


@pytest.mark.parametrize("window", [None, 1, 3, 8])
def test_first_visible_position_agrees_with_the_mask(window):
    keys = torch.arange(12)
    for p in range(12):
        visible = causal_window_mask(torch.tensor(p), keys, window)
        assert int(visible.nonzero()[0]) == first_visible_position(p, window)
        assert bool(visible[first_visible_position(p, window) : p + 1].all())


def test_written_slots_skip_padding():
    slots, index = paged_kv.written_slots(torch.tensor([4, -1, 7, -1], dtype=torch.int32))
    assert slots.dtype == torch.int64 and slots.tolist() == [4, 7] and index.tolist() == [0, 2]
    slots, index = paged_kv.written_slots(torch.tensor([3, 5]))
    assert slots.tolist() == [3, 5] and index is None

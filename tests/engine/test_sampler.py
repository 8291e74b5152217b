"""The sampler's greedy path: ``greedy_tokens`` must be exactly ``argmax`` (first maximal index)."""

from __future__ import annotations

import pytest
import torch

from llmhal.engine.sampler import greedy_tokens


@pytest.mark.parametrize("shape", [(32, 49152), (1, 49152), (3, 5000), (2, 4096), (2, 100)])
def test_greedy_tokens_equal_argmax_on_random_rows(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(greedy_tokens(x), x.argmax(-1))


def test_greedy_tokens_take_the_first_of_tied_maxima():
    x = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0))  # 48 whole chunks
    x[0, :] = 1.0  # all tied: index 0
    x[1, 49151] = 100.0  # the last element
    x[2, 49000] = x[2, 100] = 100.0  # tie across chunks: the earlier one
    x[3, 2047] = x[3, 1024] = 100.0  # tie inside one chunk
    x[4, 7] = float("nan")  # argmax reports the NaN's position
    x[5, :] = float("-inf")
    x[5, 3000] = -1e30
    expected = x.argmax(-1)
    assert expected[:6].tolist() == [0, 49151, 100, 1024, 7, 3000]
    assert torch.equal(greedy_tokens(x), expected)


def test_greedy_tokens_see_the_tail_past_the_last_whole_chunk():
    # 128256 (Llama 3's vocabulary) = 125 chunks of 1024 + a 256-element tail.
    x = torch.randn(6, 128256, generator=torch.Generator().manual_seed(1))
    x[0, 128255] = 100.0  # the maximum in the tail
    x[1, 128000] = x[1, 5] = 100.0  # tie between a chunk and the tail: the earlier one
    x[2, 128100] = float("nan")  # the only NaN, in the tail
    x[3, 128001] = x[3, 128200] = 100.0  # tie inside the tail
    x[4, :] = float("-inf")  # nothing but -inf: index 0
    expected = x.argmax(-1)
    assert expected[:5].tolist() == [128255, 5, 128100, 128001, 0]
    assert torch.equal(greedy_tokens(x), expected)


def test_greedy_tokens_of_no_rows():
    assert greedy_tokens(torch.empty(0, 49152)).shape == (0,)


def test_greedy_tokens_on_a_non_contiguous_view():
    x = torch.randn(49152, 4, generator=torch.Generator().manual_seed(1)).t()
    assert torch.equal(greedy_tokens(x), x.argmax(-1))

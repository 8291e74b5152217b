"""The sampler's greedy path: ``greedy_tokens`` must be exactly ``argmax`` (first maximal index)."""

from __future__ import annotations

import pytest
import torch

from llmhal.engine.sampler import greedy_tokens


@pytest.mark.parametrize("shape", [(32, 49152), (1, 49152), (3, 5000), (2, 4096), (2, 100)])
def test_greedy_tokens_equal_argmax_on_random_rows(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[1]))
    assert torch.equal(greedy_tokens(x), x.argmax(-1))


def test_greedy_tokens_take_the_first_of_tied_maxima_and_see_the_tail():
    x = torch.randn(8, 49152, generator=torch.Generator().manual_seed(0))
    x[0, :] = 1.0  # all tied: index 0
    x[1, 49151] = 100.0  # in the tail past the last whole chunk
    x[2, 49000] = x[2, 100] = 100.0  # tie across chunk and tail: the earlier one
    x[3, 2047] = x[3, 1024] = 100.0  # tie inside one chunk and across chunks
    x[4, 7] = float("nan")  # argmax reports the NaN's position
    x[5, :] = float("-inf")
    x[5, 3000] = -1e30
    expected = x.argmax(-1)
    assert expected[:6].tolist() == [0, 49151, 100, 1024, 7, 3000]
    assert torch.equal(greedy_tokens(x), expected)


def test_greedy_tokens_on_a_non_contiguous_view():
    x = torch.randn(49152, 4, generator=torch.Generator().manual_seed(1)).t()
    assert torch.equal(greedy_tokens(x), x.argmax(-1))

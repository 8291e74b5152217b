"""The dense (unquantized) linear op (``dense_linear``): ``y = x @ W.T + bias`` in the weight's dtype.

``get_op("dense_linear")`` returns a *preparer*, called once per layer after its weights load
(:meth:`UnquantizedLinearMethod.process_weights_after_loading`)::

    kernel = prepare(weight)  # weight: [N, K], the loaded parameter's data

``None`` means "no faster form of this weight here": the layer keeps its parameter and runs
``torch.nn.functional.linear`` (core's preparer always answers None). A kernel is a callable
``kernel(x [..., K], bias [N] | None) -> [..., N]`` that computes exactly what ``F.linear`` on the
original weight computes, up to the rounding of the platform's GEMM, with ``weight_bytes()`` (the
memory it holds) and ``name`` (for ``llmhal doctor``'s layer descriptions). The layer then drops
its parameter: the kernel holds the only copy, in whatever layout its GEMM reads fastest.

Vocabulary tables (embeddings, tied LM heads) are never prepared: their rows are also looked up.
"""

from __future__ import annotations

from typing import Any

import torch


def prepare(weight: torch.Tensor) -> Any:
    """Core has no repacked form: every layer runs ``F.linear`` on its parameter."""
    return None

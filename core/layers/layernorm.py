"""RMSNorm with an optional fused residual add, through the dispatched ``rms_norm`` ops."""

from __future__ import annotations

import torch
from torch import nn

from llmhal.ops.registry import get_op


def default_params_dtype() -> torch.dtype:
    """The model dtype of the engine config being built, else torch's default dtype."""
    from llmhal.config import get_current_config

    try:
        return get_current_config().model.dtype
    except RuntimeError:
        return torch.get_default_dtype()


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` (HF ``LlamaRMSNorm`` numerics).

    ``forward(x)`` returns the normed tensor; ``forward(x, residual)`` first adds the residual and
    returns ``(normed, x + residual)``, so decoder layers carry the residual stream without a
    separate add.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        dtype = params_dtype or default_params_dtype()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self._norm = get_op("rms_norm")
        self._add_norm = get_op("fused_add_rms_norm")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x, self.weight, self.eps)
        return self._add_norm(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

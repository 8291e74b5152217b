"""Mamba-1 (``MambaForCausalLM``) and FalconMamba (``FalconMambaForCausalLM``: the same network
with a weightless RMSNorm on the mixer's ``dt``, ``B`` and ``C``).

The stack, norms, LM head and tensor names are Mamba-2's (:mod:`llmhal.models.mamba2`); only the
mixer differs. Each request keeps a conv state and an SSM state per layer in the state cache.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from llmhal.layers.mamba_mixer import MambaMixer
from llmhal.models.mamba2 import Mamba2ForCausalLM


class MambaForCausalLM(Mamba2ForCausalLM):
    rms_on_dt_b_c: ClassVar[bool] = False

    def build_mixer(self, config: Any, prefix: str) -> nn.Module:
        return MambaMixer(
            config.hidden_size,
            intermediate_size=config.intermediate_size,
            state_size=config.state_size,
            conv_kernel=config.conv_kernel,
            time_step_rank=int(config.time_step_rank),
            use_bias=config.use_bias,
            use_conv_bias=config.use_conv_bias,
            activation=config.hidden_act,
            rms_on_dt_b_c=self.rms_on_dt_b_c,
            rms_eps=getattr(config, "mixer_rms_eps", 1e-6),
            prefix=prefix,
        )


class FalconMambaForCausalLM(MambaForCausalLM):
    rms_on_dt_b_c = True

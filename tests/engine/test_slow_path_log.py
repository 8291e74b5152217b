"""The engine's start-up log names the slow paths (issue 18 item 3): attention and ops on core's
pure-torch reference because the platform brings nothing better. The platform is
:func:`llmhal.testing.fake_vendor.acme_distribution` (a vendor following docs/writing-a-platform.md)."""

from __future__ import annotations

import logging

from llmhal.testing import fixtures
from llmhal.testing.fake_vendor import acme_distribution

install_dists = fixtures.install_dists  # the plugin tests' fixture, shared here


def test_engine_start_up_warns_when_attention_and_ops_run_on_the_reference(
    install_dists, tiny_models, caplog
):
    from llmhal import LLM

    folder, _ = tiny_models("llama")
    install_dists(acme_distribution())
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        LLM(folder, dtype="float32", max_model_len=64)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Slow path")]
    assert len(notes) == 2, notes
    # float32: acme_attn (bf16 only) is passed over, and the reference backend itself runs.
    assert "backend 'reference' is core's reference backend" in notes[0]
    assert "acme_attn: dtype float32 not supported" in notes[0]
    assert "rms_norm" in notes[1] and "Cost:" in notes[1]

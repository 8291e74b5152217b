"""The ``llmhal`` logger tree: every package's loggers, platform packages' included, live under it."""

from __future__ import annotations

import logging

from llmhal.logger import init_logger


def test_platform_packages_log_under_the_llmhal_tree(caplog):
    # LLMHAL_LOGGING_LEVEL sets the level of "llmhal"; "llmhal_cpu.*" used to sit outside it.
    assert init_logger("llmhal_cpu.native_build").name == "llmhal.llmhal_cpu.native_build"
    assert init_logger("acme_npu.platform").name == "llmhal.acme_npu.platform"
    assert init_logger("llmhal.engine.builder").name == "llmhal.engine.builder"
    assert init_logger("llmhal").name == "llmhal"
    with caplog.at_level(logging.INFO, logger="llmhal"):
        init_logger("llmhal_cpu.native_build").info("built")
    assert [r.getMessage() for r in caplog.records] == ["built"]

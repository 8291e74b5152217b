"""The conformance kit runs each contribution (issue 18, item 2) and ships as a pytest plugin.

The package of the issue's walk passed the class-level suite although its attention backend's
implementation module did not exist: these tests build such a package and check that the kit now
fails it, naming the backend, and that a wrong op kernel and a broken quantization method are named
too. The pytest plugin (``pytest --llmhal-platform=NAME``) runs the same checks with no test file,
and costs nothing to a run that does not ask for it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from llmhal.attention.backend import AttentionBackend
from llmhal.attention.paged_kv import SharedKVLayout
from llmhal.platforms import Platform
from llmhal.quantization.base import QuantizationConfig
from llmhal.testing.contribution_checks import (
    check_attention_backend,
    check_behaviour,
    check_op_kernel,
    check_quantization_method,
)
from llmhal.testing.distributions import FakeDistribution, build_distributions, subprocess_env
from llmhal.testing.platform_conformance import check_contributions, check_platform
from llmhal.testing.pytest_plugin import KitTarget, _quant_configs

GiB = 1 << 30


class MissingImplBackend(SharedKVLayout, AttentionBackend):
    """The issue's backend: declared and importable, its implementation module missing."""

    name = "missing_impl"
    supported_dtypes = ("float32", "bfloat16")

    @staticmethod
    def get_impl_cls() -> Any:
        from no_such_vendor.attention_impl import Impl  # noqa: F401  # the bug under test

    @staticmethod
    def get_builder_cls() -> Any:
        from llmhal.attention.reference import ReferenceMetadataBuilder

        return ReferenceMetadataBuilder


def wrong_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * weight  # forgets to normalise


class NeedsSettingsConfig(QuantizationConfig):
    @classmethod
    def get_name(cls) -> str:
        return "needs_settings"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        config["bits"]  # a real method reads its checkpoint's settings
        return cls()

    def get_quant_method(self, layer: Any, prefix: str) -> Any:
        from llmhal.quantization.unquantized import UnquantizedLinearMethod

        return UnquantizedLinearMethod()


class BrokenPlatform(Platform):
    name = "broken"
    device_name = "Broken device"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 10
    attention_backends: ClassVar[dict[str, str]] = {
        "missing_impl": f"{__name__}:MissingImplBackend",
        "reference": "llmhal.attention.reference:ReferenceAttentionBackend",
    }
    op_kernels: ClassVar[dict[str, str]] = {
        "rms_norm": f"{__name__}:wrong_rms_norm",
        "silu_and_mul": "llmhal.ops.native:silu_and_mul",
        "quant_linear": "llmhal.ops.quant_linear:NativeQuantLinear",
    }
    quantization_methods: ClassVar[dict[str, str]] = {
        "needs_settings": f"{__name__}:NeedsSettingsConfig"
    }

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return 8 * GiB

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        return 6 * GiB, 8 * GiB


def test_the_class_level_suite_alone_passes_the_broken_package():
    # What the issue found: importing and type-checking the contributions sees nothing wrong.
    assert check_contributions(BrokenPlatform).problems == []


def test_kit_names_the_backend_whose_implementation_does_not_import():
    finding = check_attention_backend(BrokenPlatform(), "missing_impl")
    assert finding.problems, finding
    assert all("No module named 'no_such_vendor'" in p for p in finding.problems)
    assert "attention backend 'missing_impl' FAILED" in finding.describe()


def test_kit_passes_correct_contributions_against_the_reference():
    platform = BrokenPlatform()
    for finding in (
        check_attention_backend(platform, "reference"),
        check_op_kernel(platform, "silu_and_mul"),
        check_op_kernel(platform, "quant_linear"),
    ):
        assert (finding.problems, finding.skipped) == ((), ()), finding.describe()


def test_kit_catches_a_kernel_that_differs_from_the_native_op():
    finding = check_op_kernel(BrokenPlatform(), "rms_norm")
    assert [p.split(":")[0] for p in finding.problems] == ["float32", "bfloat16", "float16"]
    assert "values differ from the native op" in finding.problems[0]


def test_kit_asks_for_an_example_config_then_loads_the_layer():
    platform = BrokenPlatform()
    finding = check_quantization_method(platform, "needs_settings")
    assert "KeyError" in finding.problems[0]
    assert "quantization_configs = {'needs_settings'" in finding.problems[0]
    assert check_quantization_method(platform, "needs_settings", {"bits": 4}).problems == ()


def test_check_platform_reports_behaviour_by_name():
    problems, _ = check_platform(BrokenPlatform, behaviour=True)
    named = {p.split(":")[0] for p in problems}
    assert named == {
        "attention backend 'missing_impl'",
        "op kernel 'rms_norm'",
        "quantization method 'needs_settings'",
    }
    assert [f.name for f in check_behaviour(BrokenPlatform()) if f.problems] == [
        "missing_impl",
        "rms_norm",
        "needs_settings",
    ]


# ---------------------------------------------------------------------------- the pytest plugin
_BROKEN_PROBE = """
from llmhal.platforms import called_by_llmhal, platform_probe


@platform_probe("brokennpu.platform:BrokenNpuPlatform")
def probe():
    return "brokennpu.platform:BrokenNpuPlatform" if called_by_llmhal() else None
"""

_BROKEN_PLATFORM = """
from llmhal.platforms import Platform


class BrokenNpuPlatform(Platform):
    name = "brokennpu"
    device_name = "Broken NPU"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 100
    attention_backends = {"brokennpu_attn": "brokennpu.attention:Backend"}
    op_kernels = {"rms_norm": "brokennpu.ops:rms_norm", "silu_and_mul": "brokennpu.ops:silu_and_mul"}

    def get_device_total_memory(self, device_id=0):
        return 8 << 30

    def mem_get_info(self, device_id=0):
        return (6 << 30, 8 << 30)
"""

# The guide's old example, reduced: the backend imports a module the package does not ship.
_BROKEN_ATTENTION = """
from llmhal.attention.backend import AttentionBackend
from llmhal.attention.paged_kv import SharedKVLayout


class Backend(SharedKVLayout, AttentionBackend):
    name = "brokennpu_attn"
    supported_dtypes = ("float32", "bfloat16", "float16")

    @staticmethod
    def get_impl_cls():
        from brokennpu.attention_impl import Impl

        return Impl

    @staticmethod
    def get_builder_cls():
        from brokennpu.attention_impl import Builder

        return Builder
"""

_BROKEN_OPS = """
from llmhal.ops import native


def rms_norm(x, weight, eps):
    return native.rms_norm(x, weight, eps)


def silu_and_mul(x):
    return native.silu_and_mul(x) * 1.5
"""


def _pytest(*args: str, cwd: Path, path: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        # langsmith's plugin (installed here as another tool's dependency) takes seconds to import
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:langsmith_plugin",
            *args,
        ],
        cwd=cwd,
        env=subprocess_env(path),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_plugin_runs_the_kit_with_no_test_file_and_names_what_failed(tmp_path):
    dist = build_distributions(
        tmp_path / "site",
        FakeDistribution(
            "brokennpu",
            "1.0",
            {"vllm.platform_plugins": {"brokennpu": "brokennpu:probe"}},
            {
                "brokennpu/__init__.py": _BROKEN_PROBE,
                "brokennpu/platform.py": _BROKEN_PLATFORM,
                "brokennpu/attention.py": _BROKEN_ATTENTION,
                "brokennpu/ops.py": _BROKEN_OPS,
            },
        ),
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _pytest("--llmhal-platform=brokennpu", "-q", "-rA", cwd=empty, path=[dist])
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:] + proc.stderr[-2000:]
    kit = "llmhal-platform-kit[brokennpu]::TestBrokennpuKit::"
    failed = {line.split(" - ")[0] for line in out.splitlines() if line.startswith("FAILED ")}
    assert failed == {
        f"FAILED {kit}test_attention_backend_runs[brokennpu_attn]",
        f"FAILED {kit}test_op_kernel_matches_native[silu_and_mul]",
    }, out[-3000:]
    assert "No module named 'brokennpu.attention_impl'" in out
    for passed in (
        "test_contributions",
        "test_instance",
        "test_op_kernel_matches_native[rms_norm]",
    ):
        assert f"PASSED {kit}{passed}" in out


def test_plugin_without_the_option_collects_nothing_and_imports_nothing(tmp_path):
    (tmp_path / "test_probe_imports.py").write_text(
        "import sys\n\n\n"
        "def test_nothing_heavy():\n"
        "    assert 'llmhal.testing.pytest_plugin' in sys.modules\n"
        "    heavy = [m for m in ('torch', 'llmhal.platforms', 'llmhal.testing.platform_conformance')"
        " if m in sys.modules]\n"
        "    assert heavy == []\n"
    )
    proc = _pytest("-q", cwd=tmp_path, path=[])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


def test_plugin_names_the_installed_platforms_for_an_unknown_one():
    with pytest.raises(pytest.UsageError) as e:
        KitTarget.find("no_such_npu", {})
    message = str(e.value)
    assert "no installed platform plugin is called 'no_such_npu'" in message
    assert "installed: " in message and "llmhal doctor" in message


def test_plugin_finds_a_platform_by_its_declared_name_importing_no_other(install_dists,
                                                                         monkeypatch):  # fmt: skip
    # --llmhal-platform=<platform name> asks every installed probe for its name: the declared name
    # answers without the platform class, and a plugin written for vLLM is never imported.
    def npu(pkg: str, name: str, **kw: Any) -> FakeDistribution:
        probe = (
            "from llmhal.platforms import platform_probe\n"
            f"@platform_probe('{pkg}.platform:P', name='{name}')\n"
            "def probe():\n    return None\n"
        )
        platform = (
            f"from llmhal.platforms import Platform\nclass P(Platform):\n    name = '{name}'\n"
        )
        modules = {f"{pkg}/__init__.py": probe, f"{pkg}/platform.py": platform}
        eps = {"vllm.platform_plugins": {pkg: f"{pkg}:probe"}}
        return FakeDistribution(pkg, "1.0", eps, modules, **kw)

    install_dists(
        npu("kitnpu_wanted", "wanted"),
        npu("kitnpu_other", "other"),
        npu("kitnpu_for_vllm", "wanted", requires=("vllm>=0.8",)),
    )
    monkeypatch.setenv("VLLM_PLATFORM", "")  # find() sets it: unset again after the test
    target = KitTarget.find("wanted", {})
    assert (target.entry_name, target.cls.name) == ("kitnpu_wanted", "wanted")
    assert "kitnpu_other" in sys.modules  # its probe was asked
    assert "kitnpu_other.platform" not in sys.modules and "kitnpu_for_vllm" not in sys.modules


@pytest.mark.parametrize("bad", ["gguf", "gguf={not json", "gguf=[1]"])
def test_plugin_refuses_a_malformed_quant_config(bad):
    with pytest.raises(pytest.UsageError, match=re.escape(f"--llmhal-quant-config {bad!r}")):
        _quant_configs([bad])
    assert _quant_configs(['gguf={"bits": 4}']) == {"gguf": {"bits": 4}}

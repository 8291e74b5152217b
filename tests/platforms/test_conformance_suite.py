"""The platform conformance suite itself: it passes good platforms and names what is wrong in bad ones."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from llmhal.platforms import Platform, PlatformCapabilities, called_by_llmhal, platform_probe
from llmhal.testing.fake_vendor import fakenpu_distribution
from llmhal.testing.platform_conformance import (
    PlatformConformanceSuite,
    check_contributions,
    check_platform,
    check_platform_class,
    check_platform_instance,
    check_probe,
)

GiB = 1 << 30


class GoodPlatform(Platform):
    name = "good"
    device_name = "Good device"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 10
    attention_backends: ClassVar[dict[str, str]] = {
        "reference": "llmhal.attention.reference:ReferenceAttentionBackend"
    }
    op_kernels: ClassVar[dict[str, str]] = {"rms_norm": "llmhal.ops.native:rms_norm"}
    supported_quantization = ("gguf",)

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return 8 * GiB

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        return 6 * GiB, 8 * GiB


@platform_probe(f"{__name__}:GoodPlatform")
def good_probe() -> str | None:
    return f"{__name__}:GoodPlatform" if called_by_llmhal() else None


class TestGoodPlatformConformance(PlatformConformanceSuite):
    """The pytest base class, exactly as a vendor package uses it."""

    platform_cls = GoodPlatform
    probe = staticmethod(good_probe)


def test_a_good_platform_has_no_problems():
    assert check_platform(GoodPlatform) == ([], [])


class BadClass(Platform):
    PLATFORM_API_VERSION = 7
    name = "Bad Name"
    device_type = ""
    dist_backend = "gloo"
    device_control_env_var = "not a var"
    priority = 5
    is_fallback = True
    attention_backends: ClassVar[dict[str, str]] = {
        "Mixed": "llmhal.attention.reference:ReferenceAttentionBackend",
        "not_backend": "llmhal.platforms.interface:PlatformCapabilities",
        "missing": "no_such_vendor_module.attn:Backend",
        "wrong_attr": "llmhal.attention.reference:NoSuchBackend",
        "misnamed": "llmhal.attention.reference:ReferenceAttentionBackend",
        "badpath": "no-colon-or-dot",
    }
    op_kernels: ClassVar[dict[str, str]] = {"warp_drive": "x.y:z"}
    quantization_methods: ClassVar[dict[str, str]] = {
        "mine": "llmhal.attention.reference:ReferenceAttentionBackend"
    }
    supported_quantization = "gguf"


def _has(problems: list[str], *fragments: str) -> bool:
    return any(all(f in p for f in fragments) for p in problems)


def test_class_level_problems_are_each_named():
    problems = check_platform_class(BadClass)
    assert _has(problems, "PLATFORM_API_VERSION is 7")
    assert _has(problems, "name 'Bad Name'")
    assert _has(problems, "device_type must be a non-empty str")
    assert _has(problems, "device_name must be a non-empty str")
    assert _has(problems, "device_control_env_var")
    assert _has(problems, "fallback platform must have priority <= 0")
    assert _has(problems, "attention_backends: 'Mixed'", "lower-case")
    assert _has(problems, "attention_backends['badpath']", "not a class path")
    assert _has(problems, "op_kernels: 'warp_drive'", "not an llmhal op")
    assert _has(problems, "supported_quantization must be None or a sequence")
    assert check_platform_class(int) == [
        "<class 'int'> is not a subclass of llmhal.platforms.Platform"
    ]


def test_accelerator_priority_must_beat_fallbacks():
    class Zero(GoodPlatform):
        priority = 0

    assert _has(check_platform_class(Zero), "accelerator", "priority > 0")


def test_unknown_quantization_in_allow_list():
    class Unknown(GoodPlatform):
        supported_quantization = ("gguf", "magic4bit")

    assert _has(check_platform_class(Unknown), "'magic4bit'")


def test_contribution_problems_and_skips():
    class Contribs(GoodPlatform):
        attention_backends: ClassVar[dict[str, str]] = dict(BadClass.attention_backends)
        attention_backends.pop("badpath")
        attention_backends.pop("Mixed")
        quantization_methods: ClassVar[dict[str, str]] = dict(BadClass.quantization_methods)

    report = check_contributions(Contribs)
    problems = report.problems
    assert _has(problems, "'not_backend'", "not an AttentionBackend")
    assert _has(problems, "'missing'", "does not exist")
    assert _has(problems, "'wrong_attr'", "no attribute 'NoSuchBackend'")
    assert _has(problems, "'misnamed'", "calls itself 'reference'")
    assert _has(problems, "quantization method 'mine'", "not a QuantizationConfig")
    assert len(problems) == 5 and report.skipped == []


def test_a_module_that_cannot_import_here_is_skipped_not_failed(tmp_path, monkeypatch):
    (tmp_path / "needs_vendor_lib.py").write_text("import vendor_lib_absent_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    class NeedsLib(GoodPlatform):
        attention_backends: ClassVar[dict[str, str]] = {"vendor": "needs_vendor_lib:Backend"}

    report = check_contributions(NeedsLib)
    assert report.problems == []
    assert _has(report.skipped, "needs_vendor_lib:Backend", "vendor_lib_absent_here")


class BadInstance(GoodPlatform):
    @property
    def capabilities(self) -> PlatformCapabilities:
        return PlatformCapabilities(bf16=False, fp8_compute=True)

    @property
    def supported_dtypes(self) -> tuple[Any, ...]:
        import torch

        return (torch.bfloat16, torch.int8)

    def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
        return 9 * GiB, 4 * GiB

    def seed(self, seed: int) -> None:
        pass  # forgets to seed: draws differ

    def inference_mode(self) -> Any:
        return contextlib.nullcontext()

    def attention_backend_priority(self, requirements: Any) -> list[str]:
        return ["warp_attention"]

    def verify_quantization(self, method: str) -> None:
        pass  # accepts anything despite the allow-list


def test_instance_problems_are_each_named():
    problems = check_platform_instance(BadInstance())
    assert _has(problems, "fp8_compute without fp8_storage")
    assert _has(problems, "torch.int8", "not a floating")
    assert _has(problems, "disagree about torch.bfloat16")
    assert _has(problems, "free=9663676416 is outside")
    assert _has(problems, "total 4294967296 != get_device_total_memory() 8589934592")
    assert _has(problems, "does not reproduce torch.rand")
    assert _has(problems, "gradients are still enabled inside inference_mode()")
    assert _has(problems, "ranks 'warp_attention'")
    assert _has(problems, "verify_quantization('no-such-method') does not raise")


def test_capability_fields_keep_their_kinds():
    def with_caps(**kw: Any) -> list[str]:
        class Caps(GoodPlatform):
            @property
            def capabilities(self) -> PlatformCapabilities:
                return PlatformCapabilities(**kw)

        return check_platform_instance(Caps())

    assert with_caps(graphs=True, graph_chunk_tokens=8) == []
    assert _has(with_caps(graphs=1), "capabilities.graphs must be a bool, got 1")
    assert _has(
        with_caps(graphs=True, graph_chunk_tokens=-1), "graph_chunk_tokens must be an int >= 0"
    )
    assert _has(with_caps(graphs=True, graph_chunk_tokens=True), "must be an int >= 0, got True")
    assert _has(with_caps(graph_chunk_tokens=8), "graph_chunk_tokens without graphs")


def test_a_raising_method_is_a_problem_not_a_crash():
    class Raises(GoodPlatform):
        def mem_get_info(self, device_id: int = 0) -> tuple[int, int]:
            raise RuntimeError("driver hung")

    assert _has(check_platform_instance(Raises()), "memory: raised RuntimeError: driver hung")


def test_probe_checks():
    def hijacker() -> str:
        return "llmhal_cpu.platform:CpuPlatform"

    problems = check_probe(hijacker)
    assert _has(problems, "must return None")
    assert _has(problems, "does not declare its class")

    path = f"{GoodPlatform.__module__}:{GoodPlatform.__qualname__}"
    misnamed = platform_probe(path, name="elsewhere")(lambda: None)
    assert check_probe(misnamed, GoodPlatform) == [
        f"@platform_probe(name='elsewhere') declares another name than GoodPlatform.name "
        f"({GoodPlatform.name!r}): VLLM_PLATFORM=elsewhere would select a platform named "
        f"{GoodPlatform.name!r}; declare name={GoodPlatform.name!r}"
    ]
    named = platform_probe(path, name=GoodPlatform.name)(lambda: None)
    assert check_probe(named, GoodPlatform) == []


def test_the_fake_vendor_platform_conforms(install_dists):
    install_dists(fakenpu_distribution())
    import fakenpu
    from fakenpu.platform import FakenpuPlatform

    assert check_probe(fakenpu.probe, FakenpuPlatform) == []
    assert check_platform(FakenpuPlatform) == ([], [])

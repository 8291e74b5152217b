"""The platform-contract conformance suite: every platform package runs it in its tests.

Three levels, so a package can check what its machine allows:

* :func:`check_platform_class` — class attributes only (types, names, priority/fallback sanity, the
  API version, the shape of every contribution). Runs anywhere.
* :func:`check_contributions` — imports each declared class path whose module imports here and checks
  it subclasses the right base (attention backends :class:`~llmhal.attention.backend.AttentionBackend`,
  quantization configs :class:`~llmhal.quantization.base.QuantizationConfig`, op kernels callable).
  A module missing altogether is a problem; a module that exists but cannot be imported here (its
  optional library is absent) is reported as skipped, not as a problem.
* :func:`check_platform_instance` — a live instance (needs the device): capabilities, dtypes, memory
  queries, seeding, inference mode, synchronize, the attention priority list, quantization checks.

Each returns a list of human-readable problems (empty = conforms). :func:`assert_platform_conforms`
runs them all and raises one AssertionError listing everything.

Behaviour, on the device (:mod:`llmhal.testing.contribution_checks`): every declared attention backend
runs a prefill and a mixed decode step against the ``reference`` backend, every op kernel is compared
with core's native op, every quantization method builds and runs a tiny layer.

Without writing a test file: ``pytest --llmhal-platform=NAME`` (the pytest plugin
:mod:`llmhal.testing.pytest_plugin`) runs this suite on the installed platform ``NAME``. To keep it in
the package's own tests, subclass :class:`PlatformConformanceSuite`::

    from llmhal.testing.platform_conformance import PlatformConformanceSuite
    from my_vendor import my_probe
    from my_vendor.platform import MyPlatform

    class TestMyPlatformConformance(PlatformConformanceSuite):
        platform_cls = MyPlatform
        probe = staticmethod(my_probe)

        @classmethod
        def device_available(cls) -> bool:  # instance checks are skipped when False
            return my_device_is_present()
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from llmhal.platforms.interface import (
    SUPPORTED_PLATFORM_API_VERSIONS,
    DeviceCapability,
    Platform,
    PlatformCapabilities,
    UnspecifiedPlatform,
)
from llmhal.utils.imports import split_qualname

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_ENV_VAR = re.compile(r"^[A-Z_][A-Z0-9_]*$")
_STR_ATTRS = (
    "device_name",
    "device_type",
    "dispatch_key",
    "dist_backend",
    "simple_compile_backend",
)


@dataclass(frozen=True)
class ContributionReport:
    """Problems with declared class paths, and the paths not checked because they do not import here."""

    problems: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------- class level
def check_platform_class(cls: Any) -> list[str]:
    """Problems with ``cls``'s declared data (no instance, no import of contributions)."""
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        return [f"{cls!r} is not a subclass of llmhal.platforms.Platform"]
    if issubclass(cls, UnspecifiedPlatform):
        return [
            f"{cls.__qualname__} derives from UnspecifiedPlatform, which is not a real platform"
        ]
    out: list[str] = []
    version = cls.PLATFORM_API_VERSION
    if version not in SUPPORTED_PLATFORM_API_VERSIONS:
        out.append(
            f"PLATFORM_API_VERSION is {version!r}; this llmhal accepts "
            f"{sorted(SUPPORTED_PLATFORM_API_VERSIONS)}"
        )
    if not (isinstance(cls.name, str) and _NAME.match(cls.name)):
        out.append(f"name {cls.name!r} must be a non-empty lower-case identifier (like 'cuda')")
    for attr in _STR_ATTRS:
        value = getattr(cls, attr)
        if not (isinstance(value, str) and value):
            out.append(f"{attr} must be a non-empty str, got {value!r}")
    env = cls.device_control_env_var
    if env is not None and not (isinstance(env, str) and _ENV_VAR.match(env)):
        out.append(f"device_control_env_var must be None or a variable name, got {env!r}")
    out += _check_priority(cls)
    out += _check_mapping(cls, "attention_backends", key_rule=_lower_key)
    out += _check_mapping(cls, "op_kernels", key_rule=_known_op)
    out += _check_mapping(cls, "quantization_methods")
    out += _check_supported_quantization(cls)
    comm = cls.device_communicator_cls
    if comm is not None:
        out += _path_shape(comm, "device_communicator_cls")
    return out


def _check_priority(cls: type[Platform]) -> list[str]:
    prio, fallback = cls.priority, cls.is_fallback
    if not isinstance(fallback, bool):
        return [f"is_fallback must be a bool, got {fallback!r}"]
    if isinstance(prio, bool) or not isinstance(prio, int):
        return [f"priority must be an int, got {prio!r}"]
    if fallback and prio > 0:
        return [f"a fallback platform must have priority <= 0 so accelerators win; got {prio}"]
    if not fallback and prio <= 0:
        return [
            f"an accelerator (is_fallback=False) must have priority > 0 to beat fallbacks; got {prio}"
        ]
    return []


def _lower_key(key: str) -> str | None:
    return None if key == key.strip().lower() else "must be lower-case (names are case-insensitive)"


def _known_op(key: str) -> str | None:
    from llmhal.ops.registry import CORE_OPS

    return None if key in CORE_OPS else f"is not an llmhal op (ops: {', '.join(CORE_OPS)})"


def _path_shape(path: Any, what: str) -> list[str]:
    if not isinstance(path, str):
        return [f"{what} must be a class path string, got {type(path).__name__}"]
    try:
        split_qualname(path)
    except ValueError as e:
        return [f"{what}: {e}"]
    return []


def _check_mapping(
    cls: type[Platform], attr: str, key_rule: Callable[[str], str | None] | None = None
) -> list[str]:
    value = getattr(cls, attr)
    if not isinstance(value, Mapping):
        return [f"{attr} must be a mapping of name -> class path, got {type(value).__name__}"]
    out = []
    for key, path in value.items():
        if not (isinstance(key, str) and key):
            out.append(f"{attr}: key {key!r} must be a non-empty str")
            continue
        why = key_rule(key) if key_rule else None
        if why:
            out.append(f"{attr}: {key!r} {why}")
        out += _path_shape(path, f"{attr}[{key!r}]")
    return out


def _check_supported_quantization(cls: type[Platform]) -> list[str]:
    allowed = cls.supported_quantization
    if allowed is None:
        return []
    if isinstance(allowed, str) or not isinstance(allowed, Sequence):
        return [f"supported_quantization must be None or a sequence of names, got {allowed!r}"]
    from llmhal.quantization.registry import CORE_METHODS

    known = set(CORE_METHODS) | set(cls.quantization_methods)
    return [
        f"supported_quantization lists {name!r}, which neither core nor this platform provides "
        f"(known: {', '.join(sorted(known))})"
        for name in allowed
        if name not in known
    ]


# -------------------------------------------------------------------------------- contributions
def _import_target(path: str, what: str, report: ContributionReport) -> Any:
    """The object at ``path``; None after recording a problem or a skip."""
    module_name, attr = split_qualname(path)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            report.problems.append(f"{what} ({path}): module {missing!r} does not exist")
        else:  # the module exists but needs a library this machine lacks
            report.skipped.append(f"{what} ({path}): not importable here: {type(e).__name__}: {e}")
        return None
    for part in attr.split("."):
        if not hasattr(obj, part):
            report.problems.append(f"{what} ({path}): {module_name} has no attribute {attr!r}")
            return None
        obj = getattr(obj, part)
    return obj


def check_contributions(cls: type[Platform]) -> ContributionReport:
    """Import every declared class path that imports here and check its type and name."""
    import inspect

    from llmhal.attention.backend import AttentionBackend
    from llmhal.quantization.base import QuantizationConfig

    report = ContributionReport()
    for name, path in cls.attention_backends.items():
        obj = _import_target(path, f"attention backend {name!r}", report)
        if obj is None:
            continue
        if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
            report.problems.append(
                f"attention backend {name!r} ({path}) is not an AttentionBackend"
            )
        elif inspect.isabstract(obj):
            report.problems.append(f"attention backend {name!r} ({path}) leaves abstract methods")
        elif getattr(obj, "name", name).lower() != name:
            report.problems.append(
                f"attention backend {name!r} ({path}) calls itself {obj.name!r}; use the same name"
            )
    for name, path in cls.quantization_methods.items():
        obj = _import_target(path, f"quantization method {name!r}", report)
        if obj is None:
            continue
        if not (isinstance(obj, type) and issubclass(obj, QuantizationConfig)):
            report.problems.append(
                f"quantization method {name!r} ({path}) is not a QuantizationConfig"
            )
        elif obj.get_name() != name:
            report.problems.append(
                f"quantization method {name!r} ({path}) has get_name() == {obj.get_name()!r}"
            )
    for name, path in cls.op_kernels.items():
        obj = _import_target(path, f"op kernel {name!r}", report)
        if obj is not None and not callable(obj):
            report.problems.append(f"op kernel {name!r} ({path}) is not callable")
    if cls.device_communicator_cls:
        obj = _import_target(cls.device_communicator_cls, "device communicator", report)
        if obj is not None and not isinstance(obj, type):
            report.problems.append(
                f"device communicator ({cls.device_communicator_cls}) is not a class"
            )
    return report


# ------------------------------------------------------------------------------------- probes
def check_probe(probe: Callable[[], Any], platform_cls: type[Platform] | None = None) -> list[str]:
    """A first-party-style probe: declares its class and returns None unless llmhal calls it."""
    out = []
    try:
        answer = probe()
    except Exception as e:
        answer = None
        out.append(f"outside llmhal's resolver the probe raised {type(e).__name__}: {e}")
    if answer is not None:
        out.append(
            f"outside llmhal's resolver the probe returned {answer!r}; it must return None (call "
            f"llmhal.platforms.called_by_llmhal()) so another framework is not hijacked"
        )
    declared = getattr(probe, "llmhal_platform_class", None)
    if not isinstance(declared, str):
        out.append("the probe does not declare its class with @platform_probe('pkg.mod:Class')")
    elif platform_cls is not None:
        from llmhal.utils.imports import resolve_obj_by_qualname

        try:
            target = resolve_obj_by_qualname(declared)
        except Exception as e:
            out.append(f"@platform_probe({declared!r}) does not import: {type(e).__name__}: {e}")
        else:
            if target is not platform_cls:
                out.append(f"@platform_probe({declared!r}) names {target!r}, not {platform_cls!r}")
    name = getattr(probe, "llmhal_platform_name", None)
    if platform_cls is not None and name is not None and name != platform_cls.name:
        out.append(
            f"@platform_probe(name={name!r}) declares another name than {platform_cls.__name__}."
            f"name ({platform_cls.name!r}): VLLM_PLATFORM={name} would select a platform named "
            f"{platform_cls.name!r}; declare name={platform_cls.name!r}"
        )
    return out


# ------------------------------------------------------------------------------ instance level
def check_platform_instance(platform: Platform) -> list[str]:
    """Problems found by exercising a live instance (needs the device)."""
    out: list[str] = []
    for check in (
        _check_capabilities,
        _check_dtypes,
        _check_device_queries,
        _check_memory,
        _check_device_control,
        _check_quantization_hook,
        _check_attention_priority,
        _check_describe,
    ):
        try:
            out += check(platform)
        except Exception as e:
            out.append(f"{check.__name__.removeprefix('_check_')}: raised {type(e).__name__}: {e}")
    return out


def _check_capabilities(p: Platform) -> list[str]:
    caps = p.capabilities
    if not isinstance(caps, PlatformCapabilities):
        return [f"capabilities must be a PlatformCapabilities, got {type(caps).__name__}"]
    out = []
    for f in fields(caps):
        value = getattr(caps, f.name)
        if f.name == "extra":
            continue
        # Each field keeps its default's kind: flags are bools, counts are ints >= 0
        # (a bool is an int to Python, so a count given as True is refused too).
        if isinstance(f.default, bool):
            if not isinstance(value, bool):
                out.append(f"capabilities.{f.name} must be a bool, got {value!r}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            out.append(f"capabilities.{f.name} must be an int >= 0, got {value!r}")
    if caps.graph_chunk_tokens and not caps.graphs:
        out.append("capabilities say graph_chunk_tokens without graphs")
    if not isinstance(caps.extra, Mapping):
        out.append(f"capabilities.extra must be a mapping, got {type(caps.extra).__name__}")
    if caps.fp8_compute and not caps.fp8_storage:
        out.append("capabilities say fp8_compute without fp8_storage")
    if not isinstance(p.is_pin_memory_available(), bool):
        out.append("is_pin_memory_available() must return a bool")
    return out


def _check_dtypes(p: Platform) -> list[str]:
    import torch

    dtypes = p.supported_dtypes
    if not (isinstance(dtypes, tuple) and dtypes):
        return [f"supported_dtypes must be a non-empty tuple, got {dtypes!r}"]
    out = [
        f"supported_dtypes holds {d!r}, not a floating torch.dtype"
        for d in dtypes
        if not (isinstance(d, torch.dtype) and d.is_floating_point)
    ]
    if len(set(dtypes)) != len(dtypes):
        out.append(f"supported_dtypes repeats a dtype: {dtypes}")
    caps = p.capabilities
    for dtype, flag in ((torch.bfloat16, caps.bf16), (torch.float16, caps.fp16)):
        if (dtype in dtypes) != flag:
            out.append(f"supported_dtypes and capabilities disagree about {dtype}")
    for d in dtypes:
        try:
            p.verify_dtype(d)
        except Exception as e:
            out.append(f"verify_dtype({d}) rejects a supported dtype: {e}")
    unsupported = next((d for d in (torch.float64, torch.float16) if d not in dtypes), None)
    if unsupported is not None:
        try:
            p.verify_dtype(unsupported)
            out.append(f"verify_dtype({unsupported}) accepts a dtype not in supported_dtypes")
        except ValueError:
            pass
    return out


def _check_device_queries(p: Platform) -> list[str]:
    out = []
    count = p.device_count()
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        out.append(f"device_count() must be an int >= 1 on a usable platform, got {count!r}")
    dev_name = p.get_device_name()
    if not (isinstance(dev_name, str) and dev_name):
        out.append(f"get_device_name() must be a non-empty str, got {dev_name!r}")
    cap = p.device_capability()
    if cap is None:
        if p.has_device_capability((0, 0)):
            out.append("device_capability() is None but has_device_capability((0, 0)) is True")
    elif not isinstance(cap, DeviceCapability):
        out.append(f"device_capability() must be a DeviceCapability or None, got {cap!r}")
    else:
        if not p.has_device_capability(tuple(cap)):
            out.append(f"has_device_capability({tuple(cap)}) is False for the device's own {cap}")
        if p.has_device_capability((cap.major + 1, 0)):
            out.append(f"has_device_capability({(cap.major + 1, 0)}) is True for a {cap} device")
    phys = p.physical_device_id(0)
    if isinstance(phys, bool) or not isinstance(phys, int) or phys < 0:
        out.append(f"physical_device_id(0) must be an int >= 0, got {phys!r}")
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_memory(p: Platform) -> list[str]:
    total = p.get_device_total_memory()
    if not (_is_int(total) and total > 0):
        return [f"get_device_total_memory() must be a positive int of bytes, got {total!r}"]
    info = p.mem_get_info()
    if not (isinstance(info, tuple) and len(info) == 2 and all(map(_is_int, info))):
        return [f"mem_get_info() must be a (free, total) tuple of ints, got {info!r}"]
    out = []
    free, total2 = info
    if not 0 <= free <= total2:
        out.append(f"mem_get_info() free={free} is outside [0, total={total2}]")
    if abs(total2 - total) > total // 100:
        out.append(f"mem_get_info() total {total2} != get_device_total_memory() {total}")
    budget = p.kv_cache_memory_budget(0)
    if not (_is_int(budget) and 0 <= budget <= total):
        out.append(f"kv_cache_memory_budget(0) must be an int in [0, total], got {budget!r}")
    return out


def _check_device_control(p: Platform) -> list[str]:
    import torch

    out = []
    device = p.torch_device()
    if not isinstance(device, torch.device) or device.type != p.device_type:
        out.append(
            f"torch_device() must be a torch.device of type {p.device_type!r}, got {device!r}"
        )
        return out
    p.set_device(device)
    draws = []
    for _ in range(2):
        p.seed(1234)
        draws.append(torch.rand(16, device=device).cpu())
    if not torch.equal(draws[0], draws[1]):
        out.append("seed(1234) twice does not reproduce torch.rand on the device")
    grad_before = torch.is_grad_enabled()
    with p.inference_mode():
        if torch.is_grad_enabled():
            out.append("gradients are still enabled inside inference_mode()")
    if torch.is_grad_enabled() != grad_before:
        out.append("inference_mode() does not restore the gradient mode on exit")
    if p.synchronize() is not None:
        out.append("synchronize() must return None")
    return out


def _check_quantization_hook(p: Platform) -> list[str]:
    out = []
    allowed = p.supported_quantization
    for name in allowed if allowed is not None else ("gguf",):
        try:
            p.verify_quantization(name)
        except Exception as e:
            out.append(f"verify_quantization({name!r}) rejects an allowed method: {e}")
    if allowed is not None:
        try:
            p.verify_quantization("no-such-method")
            out.append("verify_quantization('no-such-method') does not raise ValueError")
        except ValueError:
            pass
    return out


def _check_attention_priority(p: Platform) -> list[str]:
    from llmhal.attention.backend import AttentionRequirements
    from llmhal.attention.registry import CORE_BACKENDS, normalize

    req = AttentionRequirements(
        head_size=64, num_heads=8, num_kv_heads=2, dtype=p.supported_dtypes[0]
    )
    names = p.attention_backend_priority(req)
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        return [
            f"attention_backend_priority() must return a non-empty list of names, got {names!r}"
        ]
    known = set(CORE_BACKENDS) | {normalize(n) for n in p.attention_backends}
    return [
        f"attention_backend_priority() ranks {n!r}, which neither core nor the platform provides"
        for n in names
        if normalize(n) not in known
    ]


def _check_describe(p: Platform) -> list[str]:
    info = p.describe()
    try:
        json.dumps(info)
    except (TypeError, ValueError) as e:
        return [f"describe() must be JSON-serializable: {e}"]
    if info.get("name") != p.name:
        return [f"describe()['name'] is {info.get('name')!r}, not {p.name!r}"]
    return []


# ------------------------------------------------------------------------------------ drivers
def check_platform(
    platform: Platform | type[Platform], *, instance: bool = True, behaviour: bool = False
) -> tuple[list[str], list[str]]:
    """Run every level; return (problems, skipped contribution checks).

    ``platform`` may be a class (instantiated with no arguments when ``instance``) or an instance.
    ``behaviour`` (with ``instance``) also runs every contribution on the device
    (:func:`llmhal.testing.contribution_checks.check_behaviour`); its problems start with the
    contribution's kind and name.
    """
    cls = platform if isinstance(platform, type) else type(platform)
    problems = check_platform_class(cls)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        return problems, []
    report = check_contributions(cls)
    problems += report.problems
    if instance:
        try:
            obj = platform() if isinstance(platform, type) else platform
        except Exception as e:
            problems.append(f"{cls.__qualname__}() raised {type(e).__name__}: {e}")
        else:
            problems += check_platform_instance(obj)
            if behaviour:
                from llmhal.testing.contribution_checks import check_behaviour

                for f in check_behaviour(obj):
                    problems += [f"{f.label}: {p}" for p in f.problems]
                    report.skipped.extend(f"{f.label}: {s}" for s in f.skipped)
    return problems, report.skipped


def assert_platform_conforms(platform: Platform | type[Platform], *, instance: bool = True) -> None:
    """Raise AssertionError listing every problem :func:`check_platform` finds."""
    problems, _ = check_platform(platform, instance=instance)
    if problems:
        name = getattr(platform, "__qualname__", type(platform).__qualname__)
        raise AssertionError(
            f"{name} does not conform to the llmhal platform contract:\n"
            + "".join(f"  - {p}\n" for p in problems)
        )


class PlatformConformanceSuite:
    """Pytest base class: subclass it as ``Test...`` and set :attr:`platform_cls` (and :attr:`probe`)."""

    platform_cls: ClassVar[type[Platform]]
    probe: ClassVar[Callable[[], Any] | None] = None

    @classmethod
    def device_available(cls) -> bool:
        """Whether instance checks can run here; override for a device that may be absent."""
        return True

    @staticmethod
    def _fail_on(problems: list[str], what: str) -> None:
        if problems:
            raise AssertionError(f"{what}:\n" + "".join(f"  - {p}\n" for p in problems))

    def test_class_attributes(self) -> None:
        self._fail_on(check_platform_class(self.platform_cls), "class attributes")

    def test_contributions(self) -> None:
        self._fail_on(check_contributions(self.platform_cls).problems, "declared contributions")

    def test_probe(self) -> None:
        import pytest

        if self.probe is None:
            pytest.skip("no probe given (set probe = staticmethod(my_probe))")
        self._fail_on(check_probe(type(self).probe, self.platform_cls), "probe")

    def test_instance(self) -> None:
        self._fail_on(check_platform_instance(self._live_platform()), "live instance")

    # Behaviour (on the device): one test per declared contribution, named in the test id.
    quantization_configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    """Example ``quantization_config`` per method name, for methods whose ``from_config({})`` fails."""

    def pytest_generate_tests(self, metafunc: Any) -> None:
        for arg, attr in _PARAMETRIZED.items():
            if arg in metafunc.fixturenames:
                names = list(getattr(self.platform_cls, attr))
                metafunc.parametrize(arg, names, ids=names)  # none declared: pytest skips it

    def _live_platform(self) -> Platform:
        import pytest

        if not self.device_available():
            pytest.skip(f"no {self.platform_cls.name} device here")
        return self.platform_cls()

    @staticmethod
    def _outcome(finding: Any) -> None:
        import pytest

        if finding.problems:
            raise AssertionError(finding.describe())
        if finding.skipped:
            pytest.skip(finding.describe())

    def test_attention_backend_runs(self, attention_backend: str) -> None:
        from llmhal.testing.contribution_checks import check_attention_backend

        self._outcome(check_attention_backend(self._live_platform(), attention_backend))

    def test_op_kernel_matches_native(self, op_kernel: str) -> None:
        from llmhal.testing.contribution_checks import check_op_kernel

        self._outcome(check_op_kernel(self._live_platform(), op_kernel))

    def test_quantization_method_loads_a_layer(self, quantization_method: str) -> None:
        from llmhal.testing.contribution_checks import check_quantization_method

        config = self.quantization_configs.get(quantization_method)
        self._outcome(check_quantization_method(self._live_platform(), quantization_method, config))


# test argument -> the Platform attribute whose names parametrize it
_PARAMETRIZED = {
    "attention_backend": "attention_backends",
    "op_kernel": "op_kernels",
    "quantization_method": "quantization_methods",
}

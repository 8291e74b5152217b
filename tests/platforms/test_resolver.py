"""Platform resolution rules, in this process with throwaway platform distributions."""

from __future__ import annotations

import logging
import traceback
from dataclasses import replace

import pytest

import llmhal.platforms as platforms
import llmhal.plugins as plugins
from llmhal.platforms import PlatformNotUsableError, UnspecifiedPlatform
from llmhal.platforms.resolver import PlatformResolutionError
from llmhal.testing.distributions import MARKER_DIR_ENV, marker_count
from llmhal.testing.fake_vendor import accelerator_distribution


def _probe(name: str):
    return next(p for p in platforms.get_platform_selection().probes if p.name == name)


def test_cpu_is_selected_by_probe_when_nothing_else_is_installed(install_dists):
    install_dists()
    sel = platforms.get_platform_selection()
    assert platforms.current_platform.name == "cpu"
    assert (sel.name, sel.class_path, sel.selected_by) == (
        "cpu",
        "llmhal_cpu.platform:CpuPlatform",
        "probe",
    )
    assert sel.entry_point == "llmhal_cpu"
    # The first-party accelerators are installed beside it and say why they are not used.
    for other in ("cuda", "rocm"):
        res = _probe(f"llmhal_{other}")
        assert res.status in ("unavailable", "rejected") and res.reason and res.platform == other


def test_an_accelerator_beats_the_cpu_fallback(install_dists, markers):
    install_dists(accelerator_distribution("acc_a", priority=50))
    assert platforms.current_platform.name == "acc_a"
    sel = platforms.get_platform_selection()
    assert sel.selected_by == "probe" and "cpu (priority 0)" in sel.reason
    assert marker_count(markers, "acc_a.platform") == 1


def test_highest_priority_wins(install_dists):
    install_dists(
        accelerator_distribution("acc_a", priority=50),
        accelerator_distribution("acc_b", priority=70),
    )
    assert platforms.current_platform.name == "acc_b"


def test_a_tie_is_an_error_naming_the_contenders_and_the_remedy(install_dists):
    install_dists(accelerator_distribution("acc_a"), accelerator_distribution("acc_b"))
    with pytest.raises(PlatformResolutionError) as err:
        platforms.get_current_platform()
    msg = str(err.value)
    assert "'acc_a'" in msg and "'acc_b'" in msg
    assert "VLLM_PLATFORM=acc_a" in msg and "VLLM_PLUGINS" in msg


def test_vllm_platform_selects_without_loading_others(install_dists, markers, monkeypatch):
    install_dists(accelerator_distribution("acc_a"), accelerator_distribution("acc_b"))
    monkeypatch.setenv("VLLM_PLATFORM", "acc_b")
    assert platforms.current_platform.name == "acc_b"
    sel = platforms.get_platform_selection()
    assert sel.selected_by == "VLLM_PLATFORM"
    assert marker_count(markers, "acc_a") == 0 and marker_count(markers, "acc_a.platform") == 0
    assert _probe("acc_a").status == "not loaded"
    assert "VLLM_PLATFORM=acc_b" in _probe("acc_a").reason


def test_vllm_platform_naming_an_unusable_platform_is_an_error(install_dists, monkeypatch):
    install_dists(accelerator_distribution("acc_a", probe_body="    return None\n"))
    monkeypatch.setenv("VLLM_PLATFORM", "acc_a")
    with pytest.raises(PlatformResolutionError, match="VLLM_PLATFORM='acc_a'.*returned None"):
        platforms.get_current_platform()
    platforms.set_current_platform(None)
    monkeypatch.setenv("VLLM_PLATFORM", "nope")
    with pytest.raises(PlatformResolutionError, match="no installed platform plugin or platform"):
        platforms.get_current_platform()


def test_a_raising_probe_counts_as_unavailable_with_its_reason(install_dists):
    install_dists(
        accelerator_distribution(
            "acc_a", probe_body="    raise RuntimeError('driver 550 missing')\n"
        )
    )
    assert platforms.current_platform.name == "cpu"
    res = _probe("acc_a")
    assert res.status == "unavailable"
    assert "RuntimeError" in res.reason and "driver 550 missing" in res.reason


def test_platform_unavailable_reason_is_kept_verbatim(install_dists):
    body = (
        "    from llmhal.platforms import PlatformUnavailable\n"
        "    raise PlatformUnavailable('firmware 3.1 required, found 2.0')\n"
    )
    install_dists(accelerator_distribution("acc_a", probe_body=body))
    assert _probe("acc_a").reason == "firmware 3.1 required, found 2.0"


def test_a_class_of_another_framework_is_skipped_with_a_warning(install_dists, caplog):
    install_dists(accelerator_distribution("acc_a", base="object"))
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        assert platforms.current_platform.name == "cpu"
    res = _probe("acc_a")
    assert res.status == "rejected" and "not a subclass of llmhal.platforms.Platform" in res.reason
    assert any("acc_a" in r.getMessage() and "Platform" in r.getMessage() for r in caplog.records)


def test_an_incompatible_api_version_is_rejected_naming_both(install_dists):
    install_dists(accelerator_distribution("acc_a", api_version=99))
    assert platforms.current_platform.name == "cpu"
    res = _probe("acc_a")
    assert res.status == "rejected"
    assert "version 99" in res.reason and f"version {platforms.PLATFORM_API_VERSION}" in res.reason


def test_a_platform_that_fails_to_start_is_an_error_naming_it_and_the_remedy(install_dists):
    body = "\n    def __init__(self):\n        raise RuntimeError('cannot open /dev/acc0')\n"
    install_dists(accelerator_distribution("acc_a", platform_body=body))
    with pytest.raises(PlatformResolutionError) as err:
        platforms.get_current_platform()
    msg = str(err.value)
    assert "'acc_a' (acc_a-fake 1.0.0)" in msg and "RuntimeError: cannot open /dev/acc0" in msg
    assert "VLLM_PLATFORM=llmhal_cpu" in msg
    # What each probe said travels with the error (llmhal doctor shows it).
    said = {p.name: p.status for p in err.value.probes}
    assert said["acc_a"] == "available" and said["llmhal_cpu"] == "available"


def test_a_probe_calling_sys_exit_counts_as_unavailable(install_dists):
    install_dists(accelerator_distribution("acc_a", probe_body="    raise SystemExit(3)\n"))
    assert platforms.current_platform.name == "cpu"
    res = _probe("acc_a")
    assert res.status == "unavailable" and "SystemExit" in res.reason


def test_a_broken_class_path_is_an_error_only_for_a_plugin_the_user_listed(
    install_dists, monkeypatch
):
    body = "    return 'acc_a.no_such_module:AccA'\n"
    install_dists(accelerator_distribution("acc_a", probe_body=body))
    assert platforms.current_platform.name == "cpu"  # installed, not asked for: a warning
    assert "could not import acc_a.no_such_module" in _probe("acc_a").reason
    platforms.set_current_platform(None)
    monkeypatch.setenv("VLLM_PLUGINS", "acc_a,llmhal_cpu")
    with pytest.raises(PlatformResolutionError, match="listed in VLLM_PLUGINS.*no_such_module"):
        platforms.get_current_platform()


def test_no_platform_installed_gives_unspecified_naming_the_package(install_dists, monkeypatch):
    install_dists()
    monkeypatch.setattr(plugins, "discover", lambda group: [])
    platform = platforms.current_platform
    assert isinstance(platform, UnspecifiedPlatform)
    sel = platforms.get_platform_selection()
    assert sel.selected_by == "none" and "pip install llmhal[cpu]" in sel.reason
    with pytest.raises(PlatformNotUsableError, match=r"pip install llmhal\[cpu\]"):
        platform.mem_get_info()
    with pytest.raises(PlatformNotUsableError, match=r"pip install llmhal\[cpu\]"):
        platform.attention_backend_priority(None)


def test_empty_allow_list_blames_the_variable(install_dists, monkeypatch):
    install_dists()
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert isinstance(platforms.current_platform, UnspecifiedPlatform)
    reason = platforms.get_platform_selection().reason
    assert reason.startswith("VLLM_PLUGINS='' allows none of the installed platform plugins")
    assert "VLLM_PLUGINS=llmhal_cpu,llmhal_cuda,llmhal_rocm" in reason
    # The error of any use states that cause first, not "install llmhal[cpu]" (cpu is installed).
    with pytest.raises(PlatformNotUsableError) as err:
        platforms.current_platform.supported_dtypes  # noqa: B018
    msg = str(err.value)
    assert msg.startswith("No llmhal platform is active: VLLM_PLUGINS=''")
    assert "pip install" not in msg and "choose a dtype" in msg


def test_touching_current_platform_in_a_probe_is_a_clear_error(install_dists):
    body = "    import llmhal.platforms\n    llmhal.platforms.current_platform\n    return None\n"
    install_dists(accelerator_distribution("acc_a", probe_body=body))
    with pytest.raises(PlatformResolutionError) as err:
        platforms.get_current_platform()
    msg = str(err.value)
    assert "probe of platform plugin 'acc_a'" in msg and "acc_a-fake 1.0.0" in msg
    assert "acc_a/__init__.py" in msg  # the stack shows who touched it


def test_touching_current_platform_at_import_is_a_clear_error(install_dists):
    prelude = "import llmhal.platforms\nllmhal.platforms.current_platform\n"
    install_dists(accelerator_distribution("acc_a", probe_prelude=prelude))
    with pytest.raises(PlatformResolutionError) as err:
        platforms.get_current_platform()
    assert "importing plugin 'acc_a'" in str(err.value)


def test_first_party_probes_return_none_outside_the_resolver():
    import llmhal_cpu
    import llmhal_cuda
    import llmhal_rocm

    for probe, name in (
        (llmhal_cpu.cpu_platform_plugin, "cpu"),
        (llmhal_cuda.cuda_platform_plugin, "cuda"),
        (llmhal_rocm.rocm_platform_plugin, "rocm"),
    ):
        assert probe() is None
        assert isinstance(probe.llmhal_platform_class, str)
        # Declared, so VLLM_PLATFORM=<name> finds the renamed entry point without other probes.
        assert probe.llmhal_platform_name == name


def test_set_current_platform_swaps_and_forgets(install_dists):
    install_dists()
    from llmhal_cpu.platform import CpuPlatform

    custom = CpuPlatform()
    platforms.set_current_platform(custom)
    assert platforms.current_platform is custom
    assert platforms.get_platform_selection().selected_by == "set_current_platform"
    platforms.set_current_platform(None)
    assert platforms.current_platform is not custom


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        platforms.nonsense  # noqa: B018


def test_doctor_shows_what_each_probe_said_when_resolution_fails(install_dists):
    from llmhal import doctor

    install_dists(accelerator_distribution("acc_a"), accelerator_distribution("acc_b"))
    report = doctor.collect()
    assert report["platform"]["selected_by"] == "error"
    said = {p["name"]: p["status"] for p in report["platform"]["probes"]}
    assert said["acc_a"] == said["acc_b"] == "available"
    rows = {p["name"]: p for p in report["plugins"] if p["name"] in ("acc_a", "acc_b")}
    assert all("probe found a device" in str(row) for row in rows.values())


def test_a_backend_of_another_available_platform_says_how_to_select_it(install_dists):
    from llmhal import doctor

    install_dists(accelerator_distribution("acc_a", priority=50))
    report = doctor.collect()
    assert report["platform"]["name"] == "acc_a"
    cpu_attn = next(b for b in report["attention_backends"] if b["name"] == "cpu_attn")
    assert cpu_attn["available"] is False
    assert "VLLM_PLATFORM=cpu selects that platform" in cpu_attn["reasons"][0]
    # A platform whose probe found nothing gets no such advice.
    cuda = [b for b in report["attention_backends"] if b.get("provider") == "cuda"]
    assert cuda and all("VLLM_PLATFORM" not in b["reasons"][0] for b in cuda)


def _counting_probe(name: str, then: str) -> str:
    """A probe body that records each call in the marker folder, then runs ``then``."""
    return (
        "    import os\n"
        f"    with open(os.path.join(os.environ[{MARKER_DIR_ENV!r}], '{name}.probed'), 'a') as f:\n"
        "        f.write('x\\n')\n" + then
    )


def test_a_raising_probe_the_user_listed_is_an_error_with_its_message(install_dists, monkeypatch):
    body = "    raise RuntimeError('driver 550 missing')\n"
    install_dists(accelerator_distribution("acc_a", probe_body=body))
    monkeypatch.setenv("VLLM_PLUGINS", "acc_a,llmhal_cpu")
    with pytest.raises(PlatformResolutionError) as err:
        platforms.get_current_platform()
    msg = str(err.value)
    assert "'acc_a' (acc_a-fake 1.0.0)" in msg and "RuntimeError: driver 550 missing" in msg
    assert "remove 'acc_a' from VLLM_PLUGINS" in msg
    # Saying "no device" politely is not a failure, listed or not.
    platforms.set_current_platform(None)
    install_dists(
        accelerator_distribution(
            "acc_b",
            probe_body="    from llmhal.platforms import PlatformUnavailable\n"
            "    raise PlatformUnavailable('no card')\n",
        )
    )
    monkeypatch.setenv("VLLM_PLUGINS", "acc_b,llmhal_cpu")
    assert platforms.current_platform.name == "cpu" and _probe("acc_b").reason == "no card"


def test_a_failed_resolution_is_remembered_across_threads(install_dists, markers):
    import threading

    install_dists(
        accelerator_distribution(
            "acc_a",
            probe_body=_counting_probe("acc_a", "    return 'acc_a.platform:AccAPlatform'\n"),
        ),
        accelerator_distribution(
            "acc_b",
            probe_body=_counting_probe("acc_b", "    return 'acc_b.platform:AccBPlatform'\n"),
        ),
    )
    errors: list[BaseException] = []

    def start():
        try:
            platforms.get_current_platform()
        except PlatformResolutionError as e:
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 8 and all("same priority" in str(e) for e in errors)
    depths = []
    for _ in range(3):  # the remembered error's traceback does not grow with each access
        with pytest.raises(PlatformResolutionError) as again:
            platforms.get_current_platform()
        depths.append(len(traceback.extract_tb(again.value.__traceback__)))
    assert depths[0] == depths[1] == depths[2], depths
    assert marker_count(markers, "acc_a.probed") == marker_count(markers, "acc_b.probed") == 1
    platforms.set_current_platform(None)  # forgetting the failure resolves again
    with pytest.raises(PlatformResolutionError):
        platforms.get_current_platform()
    assert marker_count(markers, "acc_a.probed") == 2


def test_vllm_platform_matches_a_platform_name_its_probe_does_not_declare(
    install_dists, monkeypatch
):
    # Entry point "acme_npu", platform class named "acme", no name in @platform_probe.
    dist = accelerator_distribution("acme")
    dist = replace(dist, entry_points={"vllm.platform_plugins": {"acme_npu": "acme:probe"}})
    install_dists(dist)
    monkeypatch.setenv("VLLM_PLATFORM", "acme")
    assert platforms.current_platform.name == "acme"
    sel = platforms.get_platform_selection()
    assert (sel.name, sel.entry_point, sel.selected_by) == ("acme", "acme_npu", "VLLM_PLATFORM")
    # llmhal_cpu declares the name "cpu", so its probe was not called.
    assert _probe("llmhal_cpu").status == "not loaded"

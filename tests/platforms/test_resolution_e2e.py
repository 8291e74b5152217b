"""Platform resolution in fresh processes: conflicts, VLLM_PLATFORM, broken vendors, concurrency."""

from __future__ import annotations

import json

import pytest

from llmhal.testing.distributions import (
    MARKER_DIR_ENV,
    build_distributions,
    marker_count,
    run_cli,
    run_python,
)
from llmhal.testing.fake_vendor import accelerator_distribution

WHICH_PLATFORM = """
import sys
import llmhal.platforms as platforms

print(platforms.current_platform.name, platforms.get_platform_selection().selected_by)
print(*sorted(m for m in ("llmhal_cpu", "llmhal_cuda", "llmhal_rocm") if m in sys.modules))
"""


@pytest.fixture
def two_accelerators(tmp_path):
    return build_distributions(
        tmp_path / "dists", accelerator_distribution("acc_a"), accelerator_distribution("acc_b")
    )


@pytest.fixture
def marker_dir(tmp_path):
    folder = tmp_path / "markers"
    folder.mkdir()
    return folder


def test_two_accelerators_at_once_is_the_tie_error(two_accelerators):
    proc = run_python(WHICH_PLATFORM, path=[two_accelerators])
    assert proc.returncode != 0
    err = proc.stderr
    assert "PlatformResolutionError" in err
    assert "'acc_a'" in err and "'acc_b'" in err and "same priority (100)" in err
    assert "VLLM_PLATFORM=acc_a" in err and "VLLM_PLUGINS" in err


@pytest.mark.parametrize(("chosen", "other"), [("acc_a", "acc_b"), ("acc_b", "acc_a")])
def test_vllm_platform_chooses_and_never_imports_the_others(
    two_accelerators, marker_dir, chosen, other
):
    proc = run_python(
        WHICH_PLATFORM,
        path=[two_accelerators],
        env={"VLLM_PLATFORM": chosen},
        marker_dir=marker_dir,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{chosen} VLLM_PLATFORM"
    assert lines[1:] in ([], [""])  # not even the first-party probe modules were imported
    assert marker_count(marker_dir, chosen) == 1
    assert marker_count(marker_dir, other) == marker_count(marker_dir, f"{other}.platform") == 0


def test_broken_vendors_are_reported_and_the_cpu_still_wins(tmp_path):
    root = build_distributions(
        tmp_path / "dists",
        accelerator_distribution("acc_raise", probe_body="    raise KeyError('NPU_HOME')\n"),
        accelerator_distribution(
            "acc_import", probe_prelude="raise ImportError('libnpu.so.3: cannot open')\n"
        ),
        accelerator_distribution("acc_foreign", base="object"),
        accelerator_distribution("acc_future", api_version=99),
    )
    proc = run_cli("doctor", "--json", path=[root])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["platform"]["name"], report["platform"]["selected_by"]) == ("cpu", "probe")
    rows = {p["name"]: p for p in report["plugins"] if p["group"] == "vllm.platform_plugins"}
    assert rows["acc_raise"]["status"] == "unavailable"
    assert "KeyError" in rows["acc_raise"]["reason"] and "NPU_HOME" in rows["acc_raise"]["reason"]
    assert rows["acc_import"]["status"] == "failed"
    assert "libnpu.so.3" in rows["acc_import"]["reason"]
    assert rows["acc_import"]["distribution"] == "acc_import-fake"
    assert rows["acc_foreign"]["status"] == "rejected"
    assert "not a subclass of llmhal.platforms.Platform" in rows["acc_foreign"]["reason"]
    assert rows["acc_future"]["status"] == "rejected"
    assert "version 99" in rows["acc_future"]["reason"]
    # The failures were logged (once each), not only recorded.
    assert proc.stderr.count("libnpu.so.3") >= 1 and "acc_foreign" in proc.stderr


def test_an_explicitly_listed_broken_platform_is_an_error(tmp_path):
    root = build_distributions(
        tmp_path / "dists",
        accelerator_distribution("acc_import", probe_prelude="raise ImportError('libnpu.so.3')\n"),
    )
    proc = run_cli("doctor", "--json", path=[root], env={"VLLM_PLUGINS": "llmhal_cpu,acc_import"})
    assert proc.returncode != 0
    report = json.loads(proc.stdout)
    assert report["platform"]["selected_by"] == "error"
    assert "PluginLoadError" in report["platform"]["reason"]
    assert "acc_import-fake 1.0.0" in report["platform"]["reason"]


def test_resolution_happens_exactly_once_under_concurrency(tmp_path, marker_dir):
    slow_probe = (
        "    import os, time\n"
        "    time.sleep(0.3)\n"
        f"    with open(os.path.join(os.environ[{MARKER_DIR_ENV!r}], 'probe.calls'), 'a') as f:\n"
        "        f.write('x\\n')\n"
        "    return 'acc_slow.platform:AccSlowPlatform'\n"
    )
    root = build_distributions(
        tmp_path / "dists", accelerator_distribution("acc_slow", probe_body=slow_probe)
    )
    code = """
    import threading
    import llmhal.platforms as platforms

    seen = []
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        seen.append(platforms.current_platform)

    threads = [threading.Thread(target=go) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(len(seen), len({id(p) for p in seen}), seen[0].name)
    """
    proc = run_python(code, path=[root], marker_dir=marker_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["8", "1", "acc_slow"]
    assert marker_count(marker_dir, "probe.calls") == 1
    assert marker_count(marker_dir, "acc_slow.platform") == 1

"""llmhal installed beside vLLM never hijacks or breaks vLLM's platform resolution.

vLLM reads the same entry-point group. Its resolver (vllm/platforms/__init__.py, read for the facts
below, no code taken) calls each of its built-in detectors and each loaded plugin of
``vllm.platform_plugins``, notes the *names* whose call returned non-None, then splits those names
into built-in and out-of-tree by set membership, so a plugin named like an activated built-in counts
as an activated plugin; a single activated plugin beats every built-in and is called again for its
class path, which is then imported. :func:`vllm_style_resolve` is a stand-in written from those facts.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from llmhal.platforms.resolver import VLLM_BUILTIN_PLATFORMS
from llmhal.plugins import PLATFORM_PLUGINS_GROUP
from llmhal.utils.imports import resolve_obj_by_qualname

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("platforms_cpu", "platforms_cuda", "platforms_rocm")


class VllmResolutionError(RuntimeError):
    pass


def vllm_style_resolve(builtins: dict, plugins: dict) -> str:
    """The class path vLLM's resolver would pick, following its rules as documented above."""
    activated = []
    for name, fn in [*builtins.items(), *plugins.items()]:
        try:
            if fn() is not None:
                activated.append(name)
        except Exception:  # vLLM treats any exception as "not activated"
            pass
    oot = sorted(set(activated) & set(plugins))
    builtin = sorted(set(activated) & set(builtins))
    if len(oot) > 1 or (not oot and len(builtin) > 1):
        raise VllmResolutionError(
            f"Only one platform plugin can be activated, got {oot or builtin}"
        )
    if oot:
        path = plugins[oot[0]]()
    elif builtin:
        path = builtins[builtin[0]]()
    else:
        path = "vllm.platforms.interface.UnspecifiedPlatform"
    if not isinstance(path, str):  # vLLM would crash importing it; say so plainly here
        raise VllmResolutionError(f"plugin {oot or builtin} returned {path!r} when called again")
    return path


def _builtin_detectors(active: str) -> dict:
    """vLLM's detector table on a machine where only ``active`` finds its device."""
    return {
        name: (lambda n=name: f"vllm.platforms.{n}.Platform" if n == active else None)
        for name in ("tpu", "cuda", "rocm", "hpu", "xpu", "cpu", "neuron")
    }


def _installed_first_party_plugins() -> dict:
    """The loaded probes vLLM would see: every installed llmhal distribution's platform plugins."""
    out = {}
    for ep in entry_points(group=PLATFORM_PLUGINS_GROUP):
        if ep.dist is not None and ep.dist.metadata["Name"].startswith("llmhal"):
            out[ep.name] = ep.load()
    return out


def test_first_party_entry_points_avoid_vllm_builtin_names():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    for folder in FIRST_PARTY:
        data = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())
        names = set(data["project"]["entry-points"].get(PLATFORM_PLUGINS_GROUP, {}))
        assert names, folder
        assert not names & VLLM_BUILTIN_PLATFORMS, (folder, names)
    installed = _installed_first_party_plugins()
    assert {"llmhal_cpu", "llmhal_cuda", "llmhal_rocm"} <= set(installed)
    assert not set(installed) & VLLM_BUILTIN_PLATFORMS  # reinstall after renaming entry points


@pytest.mark.parametrize("active", ["cuda", "rocm", "cpu", "xpu", "tpu", None])
def test_vllm_resolution_picks_its_own_builtin_beside_llmhal(active):
    plugins = _installed_first_party_plugins()
    path = vllm_style_resolve(_builtin_detectors(active), plugins)
    expected = f"vllm.platforms.{active}.Platform" if active else "UnspecifiedPlatform"
    assert path.endswith(expected)
    # llmhal's probes said None to vLLM: none of them activated, whatever the machine has.
    assert all(probe() is None for probe in plugins.values())


def test_the_stand_in_reproduces_the_clash_of_a_builtin_name():
    """The failure the rename fixes: a first-party probe named ``cuda`` on a GPU machine."""
    import llmhal_cuda

    plugins = {"cuda": llmhal_cuda.cuda_platform_plugin}
    with pytest.raises(VllmResolutionError, match="returned None"):
        vllm_style_resolve(_builtin_detectors("cuda"), plugins)
    renamed = {"llmhal_cuda": llmhal_cuda.cuda_platform_plugin}
    assert vllm_style_resolve(_builtin_detectors("cuda"), renamed) == "vllm.platforms.cuda.Platform"


def test_a_real_out_of_tree_vllm_plugin_still_wins_in_vllm_beside_llmhal():
    plugins = _installed_first_party_plugins() | {"dummy_vllm": lambda: "vendor.DummyPlatform"}
    assert vllm_style_resolve(_builtin_detectors("cuda"), plugins) == "vendor.DummyPlatform"


def test_vllm_platform_by_platform_name_still_selects_the_first_party_platform(
    install_dists, monkeypatch
):
    import llmhal.platforms as platforms

    install_dists()
    monkeypatch.setenv("VLLM_PLATFORM", "cpu")
    assert platforms.current_platform.name == "cpu"
    sel = platforms.get_platform_selection()
    assert (sel.selected_by, sel.entry_point) == ("VLLM_PLATFORM", "llmhal_cpu")
    said = {p.name: p for p in sel.probes}
    # The accelerators' probes declare other platform names, so they were never called.
    for other in ("llmhal_cuda", "llmhal_rocm"):
        assert said[other].status == "not loaded" and "VLLM_PLATFORM=cpu" in said[other].reason
    assert resolve_obj_by_qualname(sel.class_path) is type(platforms.current_platform)


def test_a_platform_plugin_named_like_a_vllm_builtin_is_warned_about(install_dists, caplog):
    import logging

    import llmhal.platforms as platforms
    from llmhal.testing.fake_vendor import accelerator_distribution

    install_dists(accelerator_distribution("neuron", priority=50))
    with caplog.at_level(logging.WARNING, logger="llmhal"):
        assert platforms.current_platform.name == "neuron"  # it still works in llmhal
    said = [r.getMessage() for r in caplog.records if "vLLM's built-in platforms" in r.getMessage()]
    assert len(said) == 1 and "'neuron' (neuron-fake 1.0.0)" in said[0]


def test_vllm_loading_llmhals_probes_imports_nothing_heavy_and_activates_nothing():
    """What vLLM's process sees: each llmhal probe loaded by its entry point and called cold."""
    from llmhal.testing.distributions import run_python

    code = """
    import sys
    from importlib.metadata import entry_points

    said = {ep.name: ep.load()() for ep in entry_points(group="vllm.platform_plugins")
            if ep.dist.metadata["Name"].startswith("llmhal")}
    print(sorted(said.items()), "torch" in sys.modules)
    """
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    expected = "[('llmhal_cpu', None), ('llmhal_cuda', None), ('llmhal_rocm', None)] False"
    assert proc.stdout.strip() == expected

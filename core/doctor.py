"""``llmhal doctor``: what is installed, what loaded, which platform won and why, what works here.

:func:`collect` builds one JSON-able report; :func:`format_report` renders it for people. Nothing in
here raises on a broken installation: every failure becomes a reason in the report. The exit code
of :func:`main` is 0 when a platform is usable, 1 otherwise.

Report keys: ``llmhal`` (versions), ``platform`` {name, class, selected_by, reason, device, probes},
``plugins`` [{group, name, value, distribution, version, status, reason}], ``attention_backends``
[{name, provider, class_path, available, reasons, kind}] (kind: the layer kind it serves, e.g. mha,
mamba2), ``quantization_methods`` [{name, provider,
class_path, supported, reasons}], ``structured_output_backends`` [{name, available, reasons}],
``tool_parsers`` and ``reasoning_parsers`` [{name, class_path, available, reasons}], ``ops``
[{name, implementation, source, note}],
``attention_selections`` [{name, selected_by, reason, requirements}] (this process's selections, then
the one the default model would get, marked ``model``: its dtype and block size come from the engine's
own rules, after the platform's ``check_and_update_config``), ``slow_paths`` [str] (where the default
model would run core's pure-torch reference code, with the cost), ``kv_cache`` {model, dtype,
kv_cache_dtype, bytes_per_token, formula, backend, formats: [{kv_cache_dtype, bytes_per_token,
formula, served, reasons}]} (the default model's KV cache per token in each format, by
:func:`llmhal.attention.kv_formats.kv_bytes_per_token`; None without a default model), ``env``
{name: value}, ``errors`` [str].
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any

from llmhal.logger import init_logger

logger = init_logger(__name__)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _versions() -> dict[str, str | None]:
    import platform as pyplatform
    from importlib.metadata import PackageNotFoundError, version

    import llmhal

    out: dict[str, str | None] = {
        "llmhal": llmhal.__version__,
        "python": pyplatform.python_version(),
    }
    for dist in ("torch", "transformers", "triton"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def _platform_section(errors: list[str]) -> tuple[Any, dict[str, Any]]:
    """(the active platform or None, the report's platform section)."""
    from llmhal.platforms import UnspecifiedPlatform, get_current_platform, get_platform_selection

    try:
        platform = get_current_platform()
        sel = get_platform_selection()
    except Exception as e:
        errors.append(f"platform resolution failed: {_error(e)}")
        section = {"name": None, "class": None, "selected_by": "error", "reason": _error(e)}
        # What each probe said still explains the failure (a tie, a platform that failed to start).
        probes = [_probe_entry(p) for p in getattr(e, "probes", ())]
        return None, section | {"usable": False, "device": None, "probes": probes}
    try:
        device = platform.describe()
    except Exception as e:
        device = {"error": _error(e)}
    section = {
        "name": sel.name,
        "class": sel.class_path,
        "selected_by": sel.selected_by,
        "reason": sel.reason,
        "usable": not isinstance(platform, UnspecifiedPlatform),
        "device": device,
        "probes": [_probe_entry(p) for p in sel.probes],
    }
    return platform, section


def _probe_entry(p: Any) -> dict[str, Any]:
    """One ProbeResult as the report's JSON."""
    return {
        "name": p.name,
        "platform": p.platform,
        "distribution": p.distribution,
        "version": p.version,
        "status": p.status,
        "class": p.class_path,
        "priority": p.priority,
        "reason": p.reason,
    }


def _plugins_section(probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every discovered entry point; a loaded platform plugin shows what its probe said."""
    from llmhal.plugins import LOADED, PLATFORM_PLUGINS_GROUP, plugin_records

    said = {p["name"]: p for p in probes}
    out = []
    for r in plugin_records():
        status, reason = r.status, r.reason
        probe = said.get(r.name) if r.group == PLATFORM_PLUGINS_GROUP else None
        if probe is not None and status == LOADED:
            status, reason = probe["status"], probe["reason"]
        out.append(
            {
                "group": r.group,
                "name": r.name,
                "value": r.value,
                "distribution": r.distribution,
                "version": r.version,
                "status": status,
                "reason": reason,
            }
        )
    return out


def _inactive_reason(provider: str, probes: list[dict[str, Any]]) -> str:
    """Why a contribution of another platform cannot be used here (the selector's wording)."""
    from llmhal.attention.selector import inactive_provider_message

    probe = next((p for p in probes if provider in (p["platform"], p["name"])), None)
    if probe is None:
        return inactive_provider_message(provider, None, "")
    return inactive_provider_message(provider, probe["status"], probe["reason"])


def _backend_reasons(entry: Any, platform: Any, probes: list[dict[str, Any]]) -> list[str]:
    from llmhal.attention.registry import is_usable_provider, load_backend_class

    if not is_usable_provider(entry):
        return [_inactive_reason(entry.provider, probes)]
    try:
        return list(load_backend_class(entry).availability(platform))
    except Exception as e:
        return [f"cannot import {entry.class_path}: {_error(e)}"]


def _entries_section(
    what: str, list_entries: Any, reasons_of: Any, flag: str, errors: list[str]
) -> list[dict[str, Any]]:
    """One row per registry entry, with its reasons; a failing listing becomes an error."""
    try:
        entries = list_entries()
    except Exception as e:
        errors.append(f"listing {what} failed: {_error(e)}")
        return []
    out = []
    for entry in entries:
        reasons = reasons_of(entry)
        out.append(
            {
                "name": entry.name,
                "provider": entry.provider,
                "class_path": entry.class_path,
                flag: not reasons,
                "reasons": reasons,
            }
        )
    return out


def _add_backend_kinds(rows: list[dict[str, Any]]) -> None:
    """Each backend's kind: from its registration, else from its class when it imports."""
    from llmhal.attention.registry import get_backend_entry, load_backend_class

    for row in rows:
        entry = get_backend_entry(row["name"])
        kind = entry.kind if entry is not None else None
        if kind is None and entry is not None:
            try:
                kind = getattr(load_backend_class(entry), "kind", None)
            except Exception:  # its reasons already say why it cannot import
                kind = None
        row["kind"] = kind or "?"


def _quantization_reasons(entry: Any, platform: Any, probes: list[dict[str, Any]]) -> list[str]:
    from llmhal.quantization.registry import CORE, REGISTERED
    from llmhal.utils.imports import resolve_obj_by_qualname

    if entry.provider not in (CORE, REGISTERED, platform.name):
        return [_inactive_reason(entry.provider, probes)]
    reasons = []
    try:
        platform.verify_quantization(entry.name)
    except ValueError as e:
        reasons.append(str(e))
    try:
        cls = resolve_obj_by_qualname(entry.class_path)
    except Exception as e:
        return [*reasons, f"cannot import {entry.class_path}: {_error(e)}"]
    try:
        reasons += list(cls.availability(platform))
        needed = cls.get_min_capability()
    except Exception as e:
        return [*reasons, f"{entry.class_path} failed its checks: {_error(e)}"]
    cap = platform.device_capability()
    if needed is not None and needed > 0 and cap is not None and cap.to_int() < needed:
        reasons.append(
            f"needs device capability {needed // 10}.{needed % 10}; this device is "
            f"{cap.as_version_str()}"
        )
    return reasons


def _ops_section() -> list[dict[str, Any]]:
    from llmhal.ops.registry import CORE_OPS, op_implementation

    out = []
    for op in CORE_OPS:
        try:
            impl = op_implementation(op)
        except Exception as e:
            out.append({"name": op, "implementation": None, "source": None, "note": _error(e)})
            continue
        out.append(
            {
                "name": impl.name,
                "implementation": impl.implementation,
                "source": impl.source,
                "note": "; ".join(n for n in (impl.note, _kernel_status(op)) if n),
            }
        )
    return out


def _kernel_status(op: str) -> str:
    """The kernel's own ``status()`` (optional: what it runs on this host and why), or ''."""
    from llmhal.ops.registry import get_op

    status = getattr(get_op(op), "status", None)
    if not callable(status):
        return ""
    try:
        return str(status())
    except Exception as e:
        return f"status() failed: {_error(e)}"


def _selections_section() -> list[dict[str, Any]]:
    from llmhal.attention.selector import recent_selections

    return [
        {
            "name": s.name,
            "selected_by": s.selected_by,
            "reason": s.reason,
            "requirements": s.requirements.describe(),
        }
        for s in recent_selections()
    ]


def _default_model_config(path: str, platform: Any, kv_cache_dtype: str = "auto") -> Any:
    """The engine config the default model would get here: the engine's auto dtype, then the
    platform's ``check_and_update_config`` (which may change the block size, cache dtype, ...).
    Reads only the GGUF header or the folder's config.json (no weights)."""
    from llmhal.attention.kv_formats import canonical_kv_cache_dtype
    from llmhal.config import CacheConfig, EngineConfig, ModelConfig
    from llmhal.engine.builder import derive_max_model_len, resolve_dtype
    from llmhal.model_loader.checkpoint import open_checkpoint
    from llmhal.model_loader.source import GGUF, resolve_source

    source = resolve_source(path)
    ckpt = open_checkpoint(source)
    cfg = ckpt.hf_config
    model = ModelConfig(
        model=path,
        hf_config=cfg,
        dtype=resolve_dtype("auto", cfg, platform, is_gguf=source.kind == GGUF),
        architecture=(getattr(cfg, "architectures", None) or ["?"])[0],
        max_model_len=derive_max_model_len(cfg, None),
        quantization=ckpt.quant_method,
        gguf_file=source.gguf_file,
    )
    cache = CacheConfig(kv_cache_dtype=canonical_kv_cache_dtype(kv_cache_dtype))
    config = EngineConfig(model=model, cache=cache)
    platform.check_and_update_config(config)
    return config


def _model_requirements(config: Any, kv_cache_dtype: str) -> Any:
    """What the model's attention layers ask of a backend (an MLA model: one latent KV head)."""
    from llmhal.attention.backend import AttentionRequirements

    cfg = config.model.hf_config
    heads = cfg.num_attention_heads
    common = dict(
        num_heads=heads, dtype=config.model.dtype, kv_cache_dtype=kv_cache_dtype,
        block_size=config.cache.block_size,
    )  # fmt: skip
    if getattr(cfg, "kv_lora_rank", None):
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return AttentionRequirements(head_size=latent, num_kv_heads=1, kind="mla", **common)
    return AttentionRequirements(
        head_size=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        **common,
    )


def _default_model_selection(
    platform: Any, kv_cache_dtype: str = "auto"
) -> tuple[dict[str, Any], Any, dict[str, Any] | None] | None:
    """The attention backend the default model (``LLMHAL_MODEL`` or the installed one) would get
    here (honours VLLM_ATTENTION_BACKEND), the selection itself (None when refused), and its KV
    cache section (:func:`_kv_cache_section`; None when the model could not be read).

    Reads only the GGUF header or config.json (no weights); None when no default model is installed.
    """
    from llmhal.attention.selector import select_attention_backend
    from llmhal.default_model import FILENAME, default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        return None
    entry: dict[str, Any] = {"model": FILENAME if path.endswith(FILENAME) else path}
    try:
        config = _default_model_config(path, platform, kv_cache_dtype)
        req = _model_requirements(config, config.cache.kv_cache_dtype)
    except Exception as e:
        entry.update(name=None, selected_by=None, reason=_error(e), requirements="")
        return entry, None, None
    try:
        sel = select_attention_backend(req, explicit=config.attention_backend)
        entry.update(
            name=sel.name,
            selected_by=sel.selected_by,
            reason=sel.reason,
            requirements=req.describe(),
        )
    except Exception as e:  # a refused explicit choice is information, not a doctor failure
        entry.update(name=None, selected_by=None, reason=_error(e), requirements="")
        return entry, None, _kv_cache_section(entry["model"], config, None)
    return entry, sel, _kv_cache_section(entry["model"], config, sel)


def _kv_cache_section(model: str, config: Any, selection: Any) -> dict[str, Any]:
    """The model's KV bytes per token in its configured ``kv_cache_dtype`` and in every format,
    by the formula the engine's load report matches, and whether the selected backend serves each."""
    from llmhal.attention.backend import KV_CACHE_DTYPES
    from llmhal.attention.kv_formats import kv_bytes_per_token

    cfg, dtype = config.model.hf_config, config.model.dtype
    rows = []
    for name in KV_CACHE_DTYPES:
        size = kv_bytes_per_token(cfg, name, dtype)
        reasons = (
            selection.backend.validate(_model_requirements(config, name))
            if selection is not None
            else ["no attention backend was selected"]
        )
        rows.append(
            dict(kv_cache_dtype=name, bytes_per_token=size.bytes, formula=size.formula,
                 served=not reasons, reasons=reasons)
        )  # fmt: skip
    chosen = next(r for r in rows if r["kv_cache_dtype"] == config.cache.kv_cache_dtype)
    return {
        "model": model,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": chosen["kv_cache_dtype"],
        "bytes_per_token": chosen["bytes_per_token"],
        "formula": chosen["formula"],
        "backend": selection.name if selection is not None else None,
        "formats": rows,
    }


def _slow_paths(platform: Any, selection: Any, errors: list[str]) -> list[str]:
    try:
        from llmhal.engine.slow_paths import slow_path_notes

        return slow_path_notes([selection] if selection is not None else [], platform)
    except Exception as e:
        errors.append(f"slow paths: {_error(e)}")
        return []


def collect(kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """The whole report (see the module docstring). Never raises for a broken installation.
    ``kv_cache_dtype`` is the cache format the default model's rows describe."""
    from llmhal import envs
    from llmhal.plugins import load_general_plugins

    errors: list[str] = []
    try:
        load_general_plugins()
    except Exception as e:
        errors.append(f"general plugins failed: {_error(e)}")
    platform, platform_section = _platform_section(errors)
    probes = platform_section["probes"]
    report: dict[str, Any] = {
        "llmhal": _versions(),
        "platform": platform_section,
        "plugins": _plugins_section(probes),
        "attention_backends": [],
        "quantization_methods": [],
        "structured_output_backends": [],
        "tool_parsers": [],
        "reasoning_parsers": [],
        "ops": [],
        "attention_selections": [],
        "slow_paths": [],
        "kv_cache": None,
        "env": envs.in_effect(),
        "errors": errors,
    }
    for key, module, cls in (("tool_parsers", "llmhal.tool_parsers.manager", "ToolParserManager"),
                             ("reasoning_parsers", "llmhal.reasoning.manager", "ReasoningParserManager")):  # fmt: skip
        try:
            report[key] = getattr(importlib.import_module(module), cls).status()
        except Exception as e:
            errors.append(f"{key.replace('_', ' ')}: {_error(e)}")
    if platform is None:
        return report
    from llmhal.attention.registry import list_attention_backends
    from llmhal.quantization.registry import list_quantization_methods

    usable = platform_section["usable"]
    inactive = ["no llmhal platform is active (see the platform's reason)"]
    report["attention_backends"] = _entries_section(
        "attention backends",
        list_attention_backends,
        lambda e: _backend_reasons(e, platform, probes) if usable else inactive,
        "available",
        errors,
    )
    _add_backend_kinds(report["attention_backends"])
    report["quantization_methods"] = _entries_section(
        "quantization methods",
        list_quantization_methods,
        lambda e: _quantization_reasons(e, platform, probes) if usable else inactive,
        "supported",
        errors,
    )
    try:
        from llmhal.structured_output.manager import backend_status

        report["structured_output_backends"] = backend_status()
    except Exception as e:
        errors.append(f"structured-output backends: {_error(e)}")
    if usable:
        report["ops"] = _ops_section()
    report["attention_selections"] = _selections_section()
    if usable:
        model = _default_model_selection(platform, kv_cache_dtype)
        if model is not None:
            report["attention_selections"].append(model[0])
            report["kv_cache"] = model[2]
        report["slow_paths"] = _slow_paths(platform, model and model[1], errors)
    return report


# ------------------------------------------------------------------------------------ rendering
def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return [f"{indent}(none)"]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)] + [r[-1]]
        out.append((indent + "  ".join(cells)).rstrip())
    return out


def format_report(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    v = report["llmhal"]
    lines = [
        "llmhal doctor",
        "  " + ", ".join(f"{k} {val}" for k, val in v.items() if val is not None),
        "",
    ]
    p = report["platform"]
    lines.append(f"Platform: {p['name'] or 'none'} ({p['class'] or 'no class'})")
    lines.append(f"  selected by: {p['selected_by']}")
    lines.append(f"  why: {p['reason']}")
    device = p.get("device") or {}
    if p.get("usable") and device.get("device_name"):
        lines.append(
            f"  device: {device['device_name']} x{device.get('device_count')} "
            f"(dtypes: {', '.join(device.get('supported_dtypes', []))})"
        )
    lines += ["", "Plugins (entry points):"]
    lines += _table(
        [
            [
                r["group"].removeprefix("vllm."),
                r["name"],
                f"{r['distribution'] or '?'} {r['version'] or ''}".strip(),
                r["status"],
                r["reason"],
            ]
            for r in report["plugins"]
        ]
    )
    lines += ["", "Attention backends:"]
    backends = sorted(report["attention_backends"], key=lambda b: (b.get("kind", "?"), b["name"]))
    lines += _table(
        [
            [b.get("kind", "?"), b["name"], b["provider"], "yes" if b["available"] else "no",
             "; ".join(b["reasons"])]
            for b in backends
        ]
    )  # fmt: skip
    lines.append(
        "  (kind: the layers a backend serves. Recurrent kinds (mamba1, mamba2, linear, short_conv) "
        "keep a per-request state in the state cache; prefix caching is off for models with such "
        "layers, since a cached block holds keys and values, not the state after it.)"
    )
    lines += ["", "Quantization methods:"]
    lines += _table(
        [
            [q["name"], q["provider"], "yes" if q["supported"] else "no", "; ".join(q["reasons"])]
            for q in report["quantization_methods"]
        ]
    )
    lines += ["", "Structured-output backends:"]
    lines += _table(
        [
            [b["name"], "yes" if b["available"] else "no", "; ".join(b["reasons"])]
            for b in report["structured_output_backends"]
        ]
    )
    for key, title in (("tool_parsers", "Tool-call parsers"), ("reasoning_parsers", "Reasoning parsers")):  # fmt: skip
        lines += [
            "",
            f"{title} (--{'tool-call' if key == 'tool_parsers' else 'reasoning'}-parser):",
        ]
        lines += _table([[r["name"], "yes" if r["available"] else "no", "; ".join(r["reasons"]) or r["class_path"]] for r in report[key]])  # fmt: skip
    lines += ["", "Custom ops:"]
    lines += _table(
        [
            [o["name"], o["source"] or "-", o["implementation"] or "unavailable", o["note"]]
            for o in report["ops"]
        ]
    )
    if report["attention_selections"]:
        lines += ["", "Attention backend selection:"]
        lines += _table(
            [
                [
                    s.get("model", "this process"),
                    s["name"] or "none",
                    s["selected_by"] or "-",
                    (f"{s['requirements']}: {s['reason']}" if s["requirements"] else s["reason"])
                    .strip()
                    .replace("\n", "\n      "),
                ]
                for s in report["attention_selections"]
            ]
        )
    kv = report.get("kv_cache")
    if kv:
        lines += [
            "",
            f"KV cache of {kv['model']} ({kv['dtype']}, --kv-cache-dtype {kv['kv_cache_dtype']}):",
        ]
        lines.append(f"  {kv['bytes_per_token']} bytes per token = {kv['formula']}")
        lines += _table(
            [[r["kv_cache_dtype"], f"{r['bytes_per_token']} B/token",
              ("yes" if r["served"] else "no") + f" ({kv['backend'] or 'no backend'})",
              "; ".join(r["reasons"])]
             for r in kv["formats"]]
        )  # fmt: skip
    if report["slow_paths"]:
        lines += ["", "Slow paths (core's pure-torch reference code runs here):"]
        lines += [f"  - {note}" for note in report["slow_paths"]]
    lines += ["", "Environment:"]
    lines += _table([[k, val or "''"] for k, val in report["env"].items()])
    if report["errors"]:
        lines += ["", "Errors:"] + [f"  - {e}" for e in report["errors"]]
    usable = p.get("usable")
    lines += ["", "Status: " + ("OK" if usable else "no usable platform (see above)")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``llmhal doctor [--json]``; returns 0 when a platform is usable, 1 otherwise."""
    parser = argparse.ArgumentParser(
        prog="llmhal doctor",
        description="Show installed plugins, the selected platform and why, and what works here.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the KV cache format the default model's rows describe (auto, fp8_e4m3, fp8_e5m2, "
        "int8, nvfp4); every format's bytes per token are listed either way",
    )
    args = parser.parse_args(argv)
    report = collect(args.kv_cache_dtype)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    return 0 if report["platform"].get("usable") else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

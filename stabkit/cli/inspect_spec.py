"""`stabkit inspect SPEC`: build a model from a spec string (no download, ever) and render its map/audit.

Specs: the one model spec of every command (`stabkit.harness.models.spec`): a reference preset
(`tiny`, `small`, `gpt2`, `1b`), `hf:<model_type>` for any Hugging Face causal LM built from its config
class defaults (or at a preset size with ``--size``), `module:callable` for a user's factory. Large
models are built on the meta device (shapes and dtypes, no memory, no values), so even a 7B config
builds in well under a second; small ones (tiny, small, a factory at tiny size) on the CPU.

CLI glue, so it lives here and not in `stabkit.audit`: building a reference preset needs the
harness, which the library never imports (``tests/harness/test_one_way.py``).
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from ..audit.core import audit as run_audit
from ..discovery import inspect_model
from ..harness.models import GPT, PRESETS, preset_config
from ..harness.models.build import build
from ..harness.models.hf_build import config_class
from ..harness.models.spec import ModelSpecError, parse_model_spec


def build_from_spec(
    spec: str,
    device: str | torch.device = "meta",
    size: str | None = None,
    options: dict[str, Any] | None = None,
) -> nn.Module:
    """Build the model named by `spec` (`stabkit.harness.models.spec`) on `device` (default meta: no
    memory, no values): a preset at its size; ``hf:<type>`` at its config class's defaults (the real
    architecture's shape), or at the preset `size` when given; ``module:callable`` called with the
    preset `size`'s arguments (default tiny). `options` go over the config fields / factory arguments.

    Raises ModelSpecError (a ValueError, one line) on a bad spec.
    """
    parsed = parse_model_spec(spec, options)
    with torch.device(device):
        if parsed.kind == "preset":
            return GPT(preset_config(parsed.target))
        if parsed.kind == "hf" and size is None:
            return build_hf_defaults(parsed.target, parsed.options)
        return build(parsed, preset_config(size or "tiny"))


def build_hf_defaults(model_type: str, options: dict[str, Any]) -> nn.Module:
    """``hf:<type>`` at its config class's defaults (`options` over them)."""
    from transformers import AutoModelForCausalLM

    cls = config_class(model_type)
    try:
        config = cls(**options)
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"hf:{model_type}: {' '.join(str(exc).split())}") from None
    model: nn.Module = AutoModelForCausalLM.from_config(config)
    return model


CPU_PARAMS = 10_000_000
"""Reference presets with fewer block parameters than this are built on the CPU by `run_inspect_cli`."""


def inspect_device(spec: str, size: str | None = None) -> str:
    """Where `run_inspect_cli` builds SPEC: on the CPU when the shape it is built at is small (a tiny or
    small preset, a factory or an ``hf:`` model at such a `size`; building and tracing take milliseconds,
    while the first op on the meta device imports torch._dynamo, ~2 s of CPU), else on the meta device
    (no memory). An ``hf:`` model without `size` has its config's own, full-size shape: meta."""
    name = spec.strip()
    if name in PRESETS:
        preset: str | None = name
    elif name.startswith("hf:"):
        preset = size
    else:
        preset = size or "tiny"  # a factory is called with a preset's arguments (`build_from_spec`)
    if preset is None:
        return "meta"
    cfg = preset_config(preset)
    return "cpu" if 12 * cfg.n_layers * cfg.d_model**2 < CPU_PARAMS else "meta"


def run_inspect_cli(
    spec: str,
    audit: bool = False,
    as_json: bool = False,
    seq_len: int | None = None,
    device: str | None = None,
    size: str | None = None,
    options: dict[str, Any] | None = None,
) -> str:
    """The text `stabkit inspect [--audit] [--json] SPEC` prints: the ModelMap, plus the audit, or JSON.

    Runs once per CLI call; builds the model on `device` (default: `inspect_device(spec)`). Raises
    ValueError for a bad spec (the CLI should print it as one line, exit 2).
    """
    device = device or inspect_device(spec, size)
    model = build_from_spec(spec, device, size, options)
    mmap = inspect_model(model)
    report = run_audit(model, model_map=mmap, seq_len=seq_len) if audit else None
    if as_json:
        out: dict[str, Any] = {"spec": spec, "model_map": mmap.to_dict()}
        if report is not None:
            out["audit"] = report.to_dict()
        return json.dumps(out, indent=2)
    parts = [f"model: {spec} ({type(model).__name__}, {device} device)", mmap.describe()]
    if report is not None:
        parts.append(report.to_text())
    return "\n\n".join(parts)

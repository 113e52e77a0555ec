"""`stabkit inspect SPEC`: build a model from a spec string (no download, ever) and render its map/audit.

Specs: a reference preset (`tiny`, `small`, `gpt2`, `1b`) or `hf:<name>` for a Hugging Face
architecture built from its config class defaults. Models are built on the meta device by default
(shapes and dtypes, no memory, no values), so even a 7B config builds in well under a second.

CLI glue, so it lives here and not in `stabkit.audit`: building a reference preset needs the
harness, which the library never imports (``tests/harness/test_one_way.py``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..audit.core import audit as run_audit
from ..discovery import inspect_model
from ..harness.models import GPT, PRESETS, preset_config


def _hf(config_class: str) -> Callable[[], object]:
    def make() -> object:
        try:
            import transformers
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError(
                f"model spec needs Hugging Face transformers: pip install 'stabkit[hf]' ({exc})"
            ) from exc
        return getattr(transformers, config_class)()

    return make


HF_SPECS: dict[str, Callable[[], object]] = {
    "gpt2": _hf("GPT2Config"),
    "llama": _hf("LlamaConfig"),
    "mistral": _hf("MistralConfig"),
    "qwen2": _hf("Qwen2Config"),
}
"""`hf:<name>` -> a config factory (the config class's defaults)."""


def spec_names() -> list[str]:
    """Every spec `build_from_spec` accepts."""
    return [*PRESETS, *(f"hf:{n}" for n in HF_SPECS)]


def build_from_spec(spec: str, device: str | torch.device = "meta") -> nn.Module:
    """Build the model named by `spec` on `device` (default meta: no memory, no values).

    Raises ValueError("unknown model spec ...; use one of ...") on a bad spec.
    """
    name = spec.strip()
    if name in PRESETS:
        with torch.device(device):
            return GPT(preset_config(name))
    if name.startswith("hf:") and name[3:] in HF_SPECS:
        config = HF_SPECS[name[3:]]()
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            model: nn.Module = AutoModelForCausalLM.from_config(config)
        return model
    raise ValueError(f"unknown model spec {spec!r}; use one of {', '.join(spec_names())}")


CPU_PARAMS = 10_000_000
"""Reference presets with fewer block parameters than this are built on the CPU by `run_inspect_cli`."""


def inspect_device(spec: str) -> str:
    """Where `run_inspect_cli` builds SPEC: small reference presets (tiny, small) on the CPU, where
    building and tracing them takes milliseconds (the first op on the meta device imports
    torch._dynamo, ~2 s of CPU), everything else on the meta device (no memory)."""
    name = spec.strip()
    if name in PRESETS:
        cfg = preset_config(name)
        if 12 * cfg.n_layers * cfg.d_model**2 < CPU_PARAMS:
            return "cpu"
    return "meta"


def run_inspect_cli(
    spec: str,
    audit: bool = False,
    as_json: bool = False,
    seq_len: int | None = None,
    device: str | None = None,
) -> str:
    """The text `stabkit inspect [--audit] [--json] SPEC` prints: the ModelMap, plus the audit, or JSON.

    Runs once per CLI call; builds the model on `device` (default: `inspect_device(spec)`). Raises
    ValueError for a bad spec (the CLI should print it as one line, exit 2).
    """
    device = device or inspect_device(spec)
    model = build_from_spec(spec, device)
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

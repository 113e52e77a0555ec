"""`stabkit list [interventions|kernels|recipes|presets|advice|plugins]`: what stabkit ships, one section or all.

Runs without importing torch for recipes, presets, advice and plugins (plain data read from light
modules); `interventions` and `kernels` import their registries, which import torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import click

from .app import main

if TYPE_CHECKING:
    from ..harness.models.config import GPTConfig

SECTIONS = ("interventions", "kernels", "recipes", "presets", "advice", "plugins")


def interventions_text() -> str:
    from ..interventions import describe_registry  # imports torch (the registry holds the factories)

    return describe_registry()


def kernels_text() -> str:
    """The attention kernels stabkit reads at their entry points (and registered ones)."""
    from ..attention.kernels import KERNELS  # imports torch

    return "\n".join(kernel.describe() for kernel in KERNELS.values())


def recipes_text() -> str:
    """Each recipe with its description and what each size is expected to show."""
    from ..harness.recipes.spec.errors import RecipeError
    from ..harness.recipes.spec.loader import list_recipe_files, read_toml

    lines = []
    for path in list_recipe_files():
        try:
            doc = read_toml(path)
        except RecipeError as exc:
            lines.append(f"{path.stem}  (invalid: {exc})")
            continue
        lines.append(f"{doc.get('name', path.stem)}  ({path})")
        if doc.get("description"):
            lines.append(f"    {doc['description']}")
        for size, spec in (doc.get("sizes") or {}).items():
            if isinstance(spec, dict) and spec.get("expect"):
                lines.append(f"    {size}: {spec['expect']}")
    return "\n".join(lines) or "no recipes found (looked in ./recipes and among the built-ins)"


def _norm_params(cfg: GPTConfig, width: int) -> int:
    """Parameters of one norm of the reference GPT over `width` features (LayerNorm bias iff cfg.bias)."""
    return width * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def non_embedding_params(cfg: GPTConfig) -> int:
    """Parameters of `stabkit.harness.models.GPT(cfg)` without the token/position embeddings and the output
    head (`GPT.num_parameters()`), counted from the config alone, without building the model."""
    d, hd, ff = cfg.d_model, cfg.head_dim, cfg.ff_width
    q, kv = cfg.n_heads * hd, cfg.kv_heads * hd
    bias = int(cfg.bias)
    attn = d * q + 2 * d * kv + q * d + bias * (q + 2 * kv + d)
    if cfg.qk_norm:
        attn += 2 * _norm_params(cfg, hd)
    if cfg.n_experts:  # E experts of width expert_d_ff, and the router's gate (d -> E, no bias)
        ff = cfg.expert_d_ff or ff
    mlp = (2 if cfg.mlp == "swiglu" else 1) * (d * ff + bias * ff) + ff * d + bias * d
    if cfg.n_experts:
        mlp = cfg.n_experts * mlp + d * cfg.n_experts
    norms = (4 if cfg.norm_placement == "sandwich" else 2) * _norm_params(cfg, d)
    return cfg.n_layers * (attn + mlp + norms) + _norm_params(cfg, d)  # + final norm


def presets_text() -> str:
    """Model presets: shape, batch and non-embedding parameter count."""
    from ..harness.models.presets import PRESET_BATCH, PRESETS, preset_config

    rows = []
    for name in PRESETS:
        cfg = preset_config(name)
        rows.append(
            [
                name,
                str(cfg.d_model),
                str(cfg.n_layers),
                str(cfg.n_heads),
                str(cfg.context),
                str(PRESET_BATCH[name]),
                f"{non_embedding_params(cfg) / 1e6:.2f} M",
            ]
        )
    table = text_table(["preset", "d_model", "layers", "heads", "context", "batch", "non-emb params"], rows)
    return (
        table + "\nOther models at these sizes: --model hf:<model_type> (any causal LM of the installed "
        "transformers) or --model module:callable (your factory); see docs/guide/your-model.md"
    )


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table, left-aligned first column, right-aligned others."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def advice_text() -> str:
    try:
        from ..detectors.advice import describe_advice
    except ImportError:
        return "the advice table comes with stabkit.detectors, which is not installed"
    return str(describe_advice())


def plugins_text() -> str:
    """The registered probes, detectors and actions, with where each comes from (imports none)."""
    from ..plugins import ACTIONS, DETECTORS, PROBES

    lines = []
    for registry in (PROBES, DETECTORS, ACTIONS):
        lines.append(f"{registry.family}s:")
        lines += [f"  {name:<14} {registry.describe(name)}" for name in registry.names()]
    return "\n".join(lines)


@main.command(name="list")
@click.argument("section", required=False, type=click.Choice(SECTIONS))
def list_command(section: str | None) -> None:
    """List interventions, attention kernels, recipes, model presets, the detectors' advice table or
    the registered plug-ins (all when omitted)."""
    makers = {
        "interventions": interventions_text,
        "kernels": kernels_text,
        "recipes": recipes_text,
        "presets": presets_text,
        "advice": advice_text,
        "plugins": plugins_text,
    }
    chosen = [section] if section else list(SECTIONS)
    for i, name in enumerate(chosen):
        if len(chosen) > 1:
            click.echo(("\n" if i else "") + f"== {name} ==")
        click.echo(makers[name]())

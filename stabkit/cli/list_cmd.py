"""`stabkit list [interventions|recipes|presets|advice]`: what stabkit ships, one section or all."""

from __future__ import annotations

import click

from .app import main

SECTIONS = ("interventions", "recipes", "presets", "advice")


def interventions_text() -> str:
    from ..interventions import describe_registry

    return describe_registry()


def recipes_text() -> str:
    """Each recipe with its description and what each size is expected to show."""
    from ..recipes import RecipeError, list_recipe_files
    from ..recipes.loader import read_toml

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
    return "\n".join(lines) or "no recipes found (looked in ./recipes and next to the stabkit sources)"


def presets_text() -> str:
    """Model presets: shape, batch and non-embedding parameter count."""
    import torch

    from ..models import GPT, PRESET_BATCH, PRESETS, preset_config
    from ..recipes.report import table

    rows = []
    for name in PRESETS:
        cfg = preset_config(name)
        with torch.device("meta"):
            model = GPT(cfg)
        params = sum(
            p.numel() for n, p in model.named_parameters() if "emb" not in n and not n.startswith("head")
        )
        rows.append(
            [
                name,
                str(cfg.d_model),
                str(cfg.n_layers),
                str(cfg.n_heads),
                str(cfg.context),
                str(PRESET_BATCH[name]),
                f"{params / 1e6:.2f} M",
            ]
        )
    return table(["preset", "d_model", "layers", "heads", "context", "batch", "non-emb params"], rows)


def advice_text() -> str:
    try:
        from ..detectors import describe_advice
    except ImportError:
        return "the advice table comes with stabkit.detectors, which is not installed"
    return str(describe_advice())


@main.command(name="list")
@click.argument("section", required=False, type=click.Choice(SECTIONS))
def list_command(section: str | None) -> None:
    """List interventions, recipes, model presets or the detectors' advice table (all when omitted)."""
    makers = {
        "interventions": interventions_text,
        "recipes": recipes_text,
        "presets": presets_text,
        "advice": advice_text,
    }
    chosen = [section] if section else list(SECTIONS)
    for i, name in enumerate(chosen):
        if len(chosen) > 1:
            click.echo(("\n" if i else "") + f"== {name} ==")
        click.echo(makers[name]())

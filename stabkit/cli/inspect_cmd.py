"""`stabkit inspect SPEC`: print the ModelMap (and, with --audit, the audit) of a preset or HF config."""

from __future__ import annotations

import click

from ..harness.models.presets import PRESETS
from .app import main
from .run_cmd import SHARED_OPTIONS


@main.command(name="inspect")
@click.argument("spec")
@click.option("--audit", "with_audit", is_flag=True, help="Also list the stability and memory risks.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--size",
    type=click.Choice(list(PRESETS)),
    default=None,
    help="Build an hf: or module:callable model at this preset's size (default: an hf: model's config "
    "defaults, a factory at tiny).",
)
@SHARED_OPTIONS["model_option"]
def inspect_command(
    spec: str, with_audit: bool, as_json: bool, size: str | None, model_option: tuple[str, ...]
) -> None:
    """Show where the roles sit in SPEC: a reference preset (tiny, small, gpt2, 1b), hf:<model_type> (any
    causal LM of the installed transformers, from its config class on the meta device, no download) or
    module:callable (your factory, file.py:callable works too)."""
    from ..harness.models.spec import parse_options
    from .inspect_spec import run_inspect_cli

    options = parse_options(model_option)
    click.echo(run_inspect_cli(spec, audit=with_audit, as_json=as_json, size=size, options=options))

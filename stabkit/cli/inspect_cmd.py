"""`stabkit inspect SPEC`: print the ModelMap (and, with --audit, the audit) of a preset or HF config."""

from __future__ import annotations

import click

from .app import main


@main.command(name="inspect")
@click.argument("spec")
@click.option("--audit", "with_audit", is_flag=True, help="Also list the stability and memory risks.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def inspect_command(spec: str, with_audit: bool, as_json: bool) -> None:
    """Show where the roles sit in SPEC: a reference preset (tiny, small, gpt2, 1b) or hf:gpt2, hf:llama,
    hf:mistral, hf:qwen2 built from the config defaults on the meta device (no download)."""
    from .inspect_spec import run_inspect_cli

    click.echo(run_inspect_cli(spec, audit=with_audit, as_json=as_json))

"""`stabkit report LOGDIR`: read a run's logs back and print its events, advice and summary."""

from __future__ import annotations

import click

from .app import main


@main.command(name="report")
@click.argument("logdir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--events",
    "max_events",
    type=click.IntRange(0),
    default=20,
    show_default=True,
    help="Events shown per variant.",
)
def report_command(logdir: str, max_events: int) -> None:
    """Summarise LOGDIR: a `stabkit run` / `stabkit sweep` output folder, or one monitored run's logdir."""
    from ..recipes.report import events_text, footer, load_run, results_table, sweep_tables, verdict_lines

    summary = load_run(logdir)
    kind = summary.get("kind", "run")
    title = f"{summary.get('recipe', logdir)} ({kind}"
    if summary.get("size"):
        title += f", {summary['size']}, {summary.get('device', '?')}, seed {summary.get('seed', '?')}, {summary.get('steps', '?')} steps"
    click.echo(title + ")")
    if not summary.get("complete", True):
        click.echo(
            "PARTIAL: " + ("interrupted" if summary.get("interrupted") else "not every variant finished")
        )
    click.echo("")
    if kind == "sweep":
        click.echo(sweep_tables(summary))
        click.echo("")
        click.echo(verdict_lines(summary))
        return
    click.echo("events and advice")
    click.echo(events_text(summary, max_events))
    click.echo("")
    click.echo(results_table(summary))
    if summary.get("verdicts"):
        click.echo("")
        click.echo(verdict_lines(summary))
    click.echo(footer(summary))

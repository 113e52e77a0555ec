"""`stabkit report LOGDIR`: read a run's logs back and print its events, advice and summary.

LOGDIR is a `stabkit run` / `sweep` output folder, or a monitored run's logdir; when that logdir
holds later runs too (``run-2``, ... — see `MonitorConfig.logdir_mode`), each run is its own row.

Logs of `LARGE` bytes or more are read with progress on stderr (`Phase`, bytes read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import click

from .app import main
from .progress import Phase

LARGE = 16 << 20
"""Reading logs of at least this many bytes (together) shows progress."""


def q(value: object) -> str:
    """A header value, or '?' when the summary does not say."""
    return "?" if value is None else str(value)


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


@contextlib.contextmanager
def reading(label: str, paths: Sequence[Path]) -> Iterator[Phase | None]:
    """A `Phase` counting the bytes of `paths` when they are large, else None."""
    total = sum(p.stat().st_size for p in paths)
    if total < LARGE:
        yield None
        return
    with Phase(f"{label} ({mib(total)})", total, fmt=mib, log_items=True) as phase:
        yield phase


@main.command(name="report")
@click.argument("logdir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--events",
    "max_events",
    type=click.IntRange(0),
    default=20,
    show_default=True,
    help="Incidents (or, in logs without incidents, events) shown per variant.",
)
@click.option("--members", is_flag=True, help="List each incident's events under it.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Also draw the runs to this PNG/SVG/PDF: loss, gradient norm, attention logit, log Z, "
    "activation RMS, events and advice (needs matplotlib: pip install 'stabkit[plot]').",
)
def report_command(logdir: str, max_events: int, members: bool, plot_path: str | None) -> None:
    """Summarise LOGDIR: a `stabkit run` / `stabkit sweep` output folder, or one monitored run's logdir."""
    from ..harness.recipes.results.report import (
        event_log,
        footer,
        load_run,
        results_legend,
        results_table,
        run_logs,
        sweep_tables,
        verdict_lines,
    )
    from ..harness.recipes.results.report_incidents import incidents_text
    from .plot_run import need_matplotlib, plot_report

    if plot_path is not None:
        need_matplotlib()
    logs = run_logs(logdir)  # a monitored run's logdir: its log, and its later runs' (run-2, ...)
    with reading(f"reading {', '.join(map(str, logs))}", logs) as phase:
        summary = load_run(logdir, progress=phase)
    kind = summary.kind
    events = ""
    if kind != "sweep":
        logs = [p for p in map(event_log, summary.variants.values()) if p is not None]
        with reading("reading the events", logs) as phase:
            events = incidents_text(summary, max_events, members, progress=phase)
    title = f"{summary.recipe or logdir} ({kind}"
    if kind == "log" and len(summary.variants) > 1:
        title += f", {len(summary.variants)} runs, each in its own folder"
    if summary.size:
        title += f", {summary.size}, {q(summary.device)}, seed {q(summary.seed)}, {q(summary.steps)} steps"
    click.echo(title + ")")
    if not summary.complete:
        click.echo("PARTIAL: " + ("interrupted" if summary.interrupted else "not every variant finished"))
    click.echo("")
    if kind == "sweep":
        if plot_path is not None:
            plot_report(summary, logdir, plot_path)  # UserInputError: a sweep is no one run
        click.echo(sweep_tables(summary))
        click.echo("")
        click.echo(verdict_lines(summary))
        return
    click.echo("events and advice")
    click.echo(events)
    click.echo("")
    click.echo(results_table(summary))
    click.echo(results_legend(summary))
    for note in sorted({n for r in summary.variants.values() for n in r.get("notes", [])}):
        click.echo(f"note: {note}")
    if summary.verdicts:
        click.echo("")
        click.echo(verdict_lines(summary))
    click.echo(footer(summary))
    if plot_path is not None:
        plot_report(summary, logdir, plot_path)
        click.echo(f"plot: {plot_path}")

"""A picture of one or more runs read back (`load_run`): `plot_runs(runs, path)` -> a matplotlib Figure.

Runs when `stabkit report LOGDIR --plot out.png` is asked for (or from a notebook), after training. Six
panels — the loss; the global gradient norm; the attention layer (and head, where per-head statistics
were logged) with the largest pre-softmax logit; log Z of the output logits; the activation RMS of the
block with the largest one; the events on a timeline — with the events marked (coloured by severity)
and the advice they carry written under the panels. Several runs (a recipe's variants, a logdir's
``run-2``, …) are drawn one colour each. Needs matplotlib (``pip install 'stabkit[plot]'``); it draws
on a `matplotlib.figure.Figure` (no pyplot, no display needed).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..events import SEVERITIES, severity_rank
from ..metric_names import path_of
from .reader import Run

SEVERITY_COLORS = {"info": "#17becf", "warning": "#ff7f0e", "critical": "#d62728"}
"""Event marker colour by `Event.severity`."""
RUN_COLORS = ("#1f4e8c", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#7f7f7f", "#000000")
"""Line colour of the 1st, 2nd, … run (none of them a severity's)."""
OTHERS = "#c8c8c8"
"""The other layers' and blocks' lines, behind the largest (one run only)."""
ADVICE_LINES = 7
"""Advice lines written under the panels, at most."""
WRAP = 165
"""Characters per line of the advice (8-point monospace across the 13-inch figure)."""


def matplotlib_figure() -> Any:
    """`matplotlib.figure.Figure`; ImportError naming the extra to install when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("drawing a run needs matplotlib: pip install 'stabkit[plot]'") from exc
    return Figure


def finite(values: np.ndarray) -> np.ndarray:
    """`values` with ±inf as NaN (a line skips them; a log axis cannot take inf)."""
    return np.where(np.isfinite(values), values, np.nan)


def widest(values: Sequence[np.ndarray]) -> bool:
    """Whether the positive values span more than two decades (then the axis is logarithmic)."""
    pos = np.concatenate([v[np.isfinite(v) & (v > 0)] for v in values] or [np.zeros(0)])
    return bool(pos.size) and float(pos.max()) > 100 * float(pos.min())


def largest(run: Run, prefix: str, suffix: str, top_level: bool = False) -> tuple[str, list[str]]:
    """Of the metrics ``<prefix><path><suffix>``: the one with the largest value logged, and all of
    them. `top_level`: only paths with no measured parent (the blocks, not their attention or MLP)."""
    names = [
        m
        for m in run.metrics
        if m.startswith(prefix) and m.endswith(suffix) and "/head." not in m[len(prefix) :]
    ]
    paths = [m[len(prefix) : -len(suffix)] for m in names]
    if top_level:
        names = [n for n, p in zip(names, paths) if not any(p.startswith(q + ".") for q in paths)]
    if not names:
        return "", []
    peaks = [np.nanmax(finite(run.series(n).values), initial=-np.inf) for n in names]
    return names[int(np.argmax(peaks))], names


def severity_at(run: Run) -> dict[int, str]:
    """Step -> the highest severity of the run's events at that step."""
    out: dict[int, str] = {}
    for e in run.events:
        if e.step not in out or severity_rank(e.severity) > severity_rank(out[e.step]):
            out[e.step] = e.severity
    return out


def mark(ax: Any, runs: Sequence[Run], lines: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Event markers on a panel: with one run, a vertical line per event step; with several, a dot on
    each run's own curve (`lines`: run name -> the steps and values drawn) at its event steps."""
    for run in runs:
        at = severity_at(run)
        if len(runs) == 1:
            for step, sev in sorted(at.items(), key=lambda kv: severity_rank(kv[1])):
                ax.axvline(
                    step, color=SEVERITY_COLORS.get(sev, "#ff7f0e"), linewidth=1.0, alpha=0.55, zorder=0
                )
            continue
        if run.name not in lines or not at:
            continue
        steps, values = lines[run.name]
        if not len(steps):
            continue
        for step, sev in at.items():
            i = min(int(np.searchsorted(steps, step)), len(steps) - 1)
            if np.isfinite(values[i]):
                ax.plot(
                    steps[i], values[i], "o", markersize=5, zorder=5,
                    color=SEVERITY_COLORS.get(sev, "#ff7f0e"), markeredgecolor="black", markeredgewidth=0.5,
                )  # fmt: skip


def draw(ax: Any, runs: Sequence[Run], pick: Any, title: str, empty: str, legend: bool = False) -> None:
    """One panel: `pick(run)` -> (label: the layer or block, [(metric, emphasised)]) per run; the
    emphasised metric in the run's colour, the others (one run only) thin and grey behind it. The
    label goes into the title when every run's is the same, else into a legend (as with `legend`)."""
    lines: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    drawn = []
    picked = [pick(run) for run in runs]
    labels = {label for label, metrics in picked if metrics}
    if len(labels) == 1 and "" not in labels:  # the same layer in every run: said once, in the title
        title = f"{title}: {labels.pop()}"
    for k, (run, (label, metrics)) in enumerate(zip(runs, picked)):
        color = RUN_COLORS[k % len(RUN_COLORS)]
        for name, main in metrics:
            s = run.series(name)
            values = finite(s.values)
            if main:
                tag = run.name + (f": {label}" if label and len(labels) > 1 else "")
                dots = "." if len(s.steps) < 40 else None  # few sampled steps: show where they are
                ax.plot(s.steps, values, color=color, linewidth=1.4, label=tag, zorder=3, marker=dots)
                lines.setdefault(run.name, (s.steps, values))
                drawn.append(values)
            elif len(runs) == 1:
                ax.plot(s.steps, values, color=OTHERS, linewidth=0.8, zorder=2)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(True, color="#e4e4e4", linewidth=0.6)
    ax.tick_params(labelsize=8)
    if not drawn:
        ax.text(
            0.5, 0.5, empty, ha="center", va="center", fontsize=8, color="#777777", transform=ax.transAxes
        )
        return
    if widest(drawn):
        ax.set_yscale("log")
    mark(ax, runs, lines)
    if legend or (len(runs) > 1 and len(labels) > 1):  # the runs' colours; which layer each run's is
        ax.legend(fontsize=7, frameon=False, ncol=2 if len(runs) > 4 else 1)


def one(name: str) -> Any:
    """A `draw` picker for one metric by name."""
    return lambda run: ("", [(name, True)] if name in run.metrics else [])


def attention(run: Run) -> tuple[str, list[tuple[str, bool]]]:
    """The layer with the largest max logit (all layers behind it); its largest head when per-head
    statistics were logged (`MonitorConfig.attn_per_head`)."""
    top, names = largest(run, "attn/", "/max_logit")
    if not top:
        return "", []
    layer = path_of(top)
    head, _ = largest(run, f"attn/{layer}/head.", "/max_logit")
    label = layer + (f" head {head.split('/head.')[1].split('/')[0]}" if head else "")
    return label, [(n, n == top) for n in names]


def activations(run: Run) -> tuple[str, list[tuple[str, bool]]]:
    """The block whose activation RMS is the largest logged (the other blocks behind it)."""
    top, names = largest(run, "act/", "/rms", top_level=True)
    return path_of(top), [(n, n == top) for n in names]


def events_panel(ax: Any, runs: Sequence[Run], limit: int = 10) -> None:
    """A timeline: one row per event kind (per run, with several), a marker per event coloured by severity."""
    rows: dict[str, list[tuple[int, str]]] = {}
    for run in runs:
        for e in run.events:
            key = e.kind if len(runs) == 1 else f"{run.name}: {e.kind}"
            rows.setdefault(key, []).append((e.step, e.severity))
    ax.set_title("events (marker colour: severity)", fontsize=9, loc="left")
    ax.grid(True, axis="x", color="#e4e4e4", linewidth=0.6)
    ax.tick_params(labelsize=8)
    if not rows:
        ax.text(
            0.5,
            0.5,
            "no events",
            ha="center",
            va="center",
            fontsize=8,
            color="#777777",
            transform=ax.transAxes,
        )
        ax.set_yticks([])
        return
    keys = sorted(rows, key=lambda k: -len(rows[k]))[:limit]
    for y, key in enumerate(keys):
        for sev in SEVERITIES:
            steps = [s for s, v in rows[key] if v == sev]
            if steps:
                ax.plot(
                    steps, [y] * len(steps), "|", markersize=12, markeredgewidth=2, color=SEVERITY_COLORS[sev]
                )
    ax.set_yticks(range(len(keys)), [f"{k} ({len(rows[k])})" for k in keys], fontsize=7)
    ax.set_ylim(-0.7, len(keys) - 0.3)
    ax.invert_yaxis()
    if len(rows) > limit:
        ax.text(
            1.0, -0.18, f"+{len(rows) - limit} more kinds", ha="right", fontsize=7, transform=ax.transAxes
        )


def advice_lines(runs: Sequence[Run]) -> list[str]:
    """What to do, once per distinct advice: where it came from (the steps, and with several runs
    which runs), the kinds of the events behind it and their highest severity."""
    groups: dict[str, dict[str, list[Any]]] = {}  # advice -> run name -> its events
    for run in runs:
        for e in run.events:
            if e.advice:
                groups.setdefault(e.advice, {}).setdefault(run.name, []).append(e)
    out = []
    for advice, by_run in groups.items():
        where = []
        for name, events in by_run.items():
            lo, hi = min(e.step for e in events), max(e.step for e in events)
            steps = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
            where.append(f"{name} {steps}" if len(runs) > 1 else steps)
        events = [e for evs in by_run.values() for e in evs]
        kinds = ", ".join(dict.fromkeys(e.kind for e in events))
        sev = max((e.severity for e in events), key=severity_rank)
        out.append(f"{', '.join(where)} [{kinds}, {sev}, {len(events)} event(s)]: {advice}")
    return out


def plot_runs(runs: Run | Sequence[Run], path: str | Path | None = None, title: str | None = None) -> Any:
    """Draw `runs` (one `Run`, or several overlaid) and save the figure to `path` (PNG, SVG or PDF by
    its suffix) when given; returns the `matplotlib.figure.Figure`. ImportError without matplotlib."""
    figure_cls = matplotlib_figure()
    runs = [runs] if isinstance(runs, Run) else list(runs)
    if not runs:
        raise ValueError("plot_runs: no run to draw")
    advice = advice_lines(runs)
    shown = advice[:ADVICE_LINES] + (
        [f"... {len(advice) - ADVICE_LINES} more"] if len(advice) > ADVICE_LINES else []
    )
    text = (
        "\n".join(textwrap.fill(a, WRAP, subsequent_indent="    ") for a in shown)
        or "no events: nothing to advise"
    )
    text_height = 0.35 + 0.16 * text.count("\n")
    fig = figure_cls(figsize=(13, 9.6 + text_height), dpi=100)
    grid = fig.add_gridspec(
        4, 2, height_ratios=[3, 3, 3, text_height * 1.1], hspace=0.45, wspace=0.2 if len(runs) == 1 else 0.32
    )
    axes = [fig.add_subplot(grid[r, c]) for r in range(3) for c in range(2)]
    draw(axes[0], runs, one("loss"), "loss", "loss not logged", legend=len(runs) > 1)
    draw(
        axes[1],
        runs,
        one("grad/global_norm"),
        "gradient norm (grad/global_norm, before clipping)",
        "not logged",
    )
    draw(
        axes[2], runs, attention, "largest attention logit (attn/*/max_logit)",
        "no attention logits logged",
    )  # fmt: skip
    draw(
        axes[3],
        runs,
        one("logits/logz_max"),
        "log Z of the output logits, largest (logits/logz_max)",
        "not logged",
    )
    draw(
        axes[4], runs, activations, "activation RMS, largest block (act/*/rms)",
        "no block activations logged",
    )  # fmt: skip
    events_panel(axes[5], runs)
    for ax in axes[4:]:
        ax.set_xlabel("step", fontsize=8)
    for ax in axes[1:]:
        ax.sharex(axes[0])  # one step axis for every panel
    note = fig.add_subplot(grid[3, :])
    note.axis("off")
    note.set_title("what to do (the advice of the events)", fontsize=9, loc="left")
    note.text(0.0, 1.0, text, va="top", ha="left", fontsize=8, family="monospace", transform=note.transAxes)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, linewidth=2, label=s) for s, c in SEVERITY_COLORS.items()]
    fig.legend(
        handles=handles,
        loc="upper right",
        bbox_to_anchor=(0.985, 0.995),
        ncol=3,
        fontsize=8,
        frameon=False,
        title="events:",
        title_fontsize=8,
    )
    where = str(runs[0].path) if len(runs) == 1 else ", ".join(r.name for r in runs)
    fig.suptitle(title or f"stabkit: {where}", fontsize=11, x=0.01, ha="left")
    fig.subplots_adjust(left=0.07, right=0.98, top=0.93, bottom=0.02)
    if path is not None:
        fig.savefig(path)
    return fig

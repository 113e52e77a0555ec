"""Text for people: the results table, the verdicts, and a run's events read back from its logs.

Used by `stabkit run` (after training), `stabkit sweep` and `stabkit report LOGDIR` (any time later:
reads ``summary.json`` and each variant's ``stabkit.jsonl``; also a single monitored run's logdir).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from ....sinks import LOG_NAME, read_jsonl
from ....sinks.rundir import run_folders
from ..run.runner import SUMMARY
from .columns import legend, shown
from .measures import best_smoothed, monitored, tail_mean
from .summary import Summary
from .verdict import CAVEAT, CAVEAT_LEGEND


def _float(value: Any) -> Any:
    if value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, dict):
        return {k: _float(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_float(v) for v in value]
    return value


class Progress(Protocol):
    """Where reading a large log reports to (the CLI's `Phase`): units are bytes."""

    def begin(self, item: str) -> None: ...

    def update(self, n: int = 1) -> None: ...


CHUNK = 4 << 20
"""`read_log` reports progress after about this many bytes."""


def read_log(path: str | Path, progress: Progress | None = None) -> list[dict[str, Any]]:
    """The rows of a stabkit JSONL log, as `sinks.read_jsonl` reads them (a torn line is skipped,
    metric values become floats), reporting the bytes read to `progress` every `CHUNK` bytes."""
    if progress is None:
        return read_jsonl(path)
    rows, pending = [], 0
    with open(path, "rb") as fh:
        for raw in fh:
            pending += len(raw)
            if pending >= CHUNK:
                progress.update(pending)
                pending = 0
            try:
                row = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if row.get("type") == "metrics":
                row["values"] = {k: float(v) for k, v in row["values"].items()}
            rows.append(row)
    progress.update(pending)
    return rows


def single_log(logdir: str | Path) -> Path | None:
    """The ``stabkit.jsonl`` `load_run` reads everything from when LOGDIR is one monitored run's
    logdir (no summary.json or sweep.json), else None."""
    root = Path(logdir)
    if (root / SUMMARY).is_file() or (root / "sweep.json").is_file() or not (root / LOG_NAME).is_file():
        return None
    return root / LOG_NAME


def run_logs(logdir: str | Path) -> list[Path]:
    """The JSONL logs `load_run` reads when LOGDIR holds monitored runs rather than a summary: the
    logdir's own and those of its later runs (``run-2``, ``run-3``, …: `stabkit.attach` puts a run
    there when the logdir already held one), in order; [] otherwise."""
    root = Path(logdir)
    if (root / SUMMARY).is_file() or (root / "sweep.json").is_file():
        return []
    return [f / LOG_NAME for f in run_folders(root) if (f / LOG_NAME).is_file()]


def load_run(logdir: str | Path, progress: Progress | None = None) -> Summary:
    """A run's `Summary`: ``summary.json`` (a recipe run or sweep), or one (kind "log") built from the monitored
    runs' ``stabkit.jsonl`` logs in LOGDIR (`run_logs`: one row per run, never mixed; bytes read
    reported to `progress`, then ``progress.begin("summarising ...")``). FileNotFoundError when LOGDIR
    holds neither."""
    root = Path(logdir)
    if (root / SUMMARY).is_file():
        return Summary.from_dict(_float(json.loads((root / SUMMARY).read_text(encoding="utf-8"))))
    if (root / "sweep.json").is_file():
        return Summary.from_dict(_float(json.loads((root / "sweep.json").read_text(encoding="utf-8"))))
    logs = run_logs(root)
    if logs:
        variants = {}
        for log in logs:
            name = root.name if log.parent == root else log.parent.name
            variants[name] = _single(log.parent, name, progress)
        return Summary(kind="log", recipe=root.name, complete=True, variants=variants)
    raise FileNotFoundError(
        f"{str(root)!r} has no {SUMMARY}, sweep.json or {LOG_NAME}; pass a stabkit logdir"
    )


def _single(folder: Path, name: str, progress: Progress | None = None) -> dict[str, Any]:
    """One monitored run's result, from its ``stabkit.jsonl``."""
    rows = read_log(folder / LOG_NAME, progress)
    history = [(r["step"], r["values"]) for r in rows if r.get("type") == "metrics"]
    if progress is not None:
        progress.begin(f"summarising {len(history)} steps")
    losses = [v["loss"] for _, v in history if "loss" in v]
    events = [r for r in rows if r.get("type") == "event"]
    starts = sum(1 for r in rows if r.get("type") == "run")
    notes = [f"{name}: {starts} runs appended to one log (logdir_mode='append')"] if starts > 1 else []
    result = {
        "variant": name,
        "role": "run",
        "status": "logged",
        "logdir": str(folder),
        "notes": notes,
        "steps_done": len(losses),
        "final_loss": tail_mean(losses),
        "best_loss": best_smoothed(losses),
        "events": len(events),
        "first_event_step": events[0]["step"] if events else math.nan,
        "first_event_kind": events[0]["kind"] if events else "",
        "event_list": events,  # every event of the log: `events_of` need not read it again
        "incident_list": [r for r in rows if r.get("type") == "incident"],  # `report_incidents`
        **monitored(history),
    }
    return result


def events_of(result: dict[str, Any], progress: Progress | None = None) -> list[dict[str, Any]]:
    """A variant's events from its ``stabkit.jsonl`` (falls back to those kept in the summary; a
    single monitored run's, read by `load_run`, are all kept there)."""
    log = event_log(result)
    if log is not None:
        return [r for r in read_log(log, progress) if r.get("type") == "event"]
    return list(result.get("event_list", []))


def event_log(result: dict[str, Any]) -> Path | None:
    """The log `events_of` reads for a variant's result (None: it uses the summary's events)."""
    if not result.get("logdir") or result.get("status") == "logged":
        return None
    log = Path(result["logdir"]) / LOG_NAME
    return log if log.is_file() else None


def num(value: Any, digits: int = 3) -> str:
    """A loss-like number ('nan' when it is one), or '-' when missing."""
    if value is None or isinstance(value, str):
        return "-"
    if math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}f}"


def big(value: Any) -> str:
    """A value that may span decades (logits): 23.4, 512, 1.7e+04."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if not math.isfinite(value):
        return "inf" if value > 0 else "-inf"
    if abs(value) >= 1e4:
        return f"{value:.1e}"
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain text table, left-aligned first column, right-aligned others."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def results_table(summary: Summary) -> str:
    """The results table (`results_rows`); a monitored run's own log ("log" summary) leaves out the
    columns that say nothing for it (`columns.shown`). `results_legend` says what each column means."""
    return table(*shown(*results_rows(summary), summary.kind))


def results_legend(summary: Summary) -> str:
    """One line per column `results_table` shows: what it means (printed under the table)."""
    headers, _ = shown(*results_rows(summary), summary.kind)
    return legend(headers)


def results_rows(summary: Summary) -> tuple[list[str], list[list[str]]]:
    """The results table's headers and cells. Per variant: final / best / held-out loss, max attention
    logit (before any cap), max log Z, mean |log Z|, mean output logit (held out), first event, above
    bigram (the summary's ``diverged``: the held-out loss non-finite or no better than a bigram
    model's), verdict.

    The column says what it measures rather than "diverged": a variant can end a little above the
    bigram level and still be within its fixed checks' tolerance of the reference (the tiny model's
    reachable loss is only ~0.2 below that level), and a row never reads "diverged yes" and "fixed".
    A mixture of experts adds MaxVio and dead experts (the worst layer, `moe_load`) before the first event."""
    moe = any("max_vio" in r for r in summary.variants.values())
    headers = [
        "variant",
        "final",
        "best",
        "val",
        "max attn logit",
        "max logZ",
        "mean|logZ|",
        "mean logit",
        *(["MaxVio", "dead experts"] if moe else []),
        "first event",
        "above bigram",
        "verdict",
    ]
    rows = []
    for name, r in summary.variants.items():
        first = "-"
        if isinstance(r.get("first_event_step"), int | float) and math.isfinite(r["first_event_step"]):
            first = f"{r['first_event_kind']}@{int(r['first_event_step'])}"
        div = r.get("diverged")
        above = (
            "-" if div is None or (isinstance(div, float) and math.isnan(div)) else ("yes" if div else "no")
        )
        verdict = summary.verdicts.get(name, {}).get("verdict", r.get("status", ""))
        logit = big(r.get("max_attn_logit"))
        if isinstance(r.get("max_attn_logit_capped"), float) and math.isfinite(r["max_attn_logit_capped"]):
            logit += f" (capped {big(r['max_attn_logit_capped'])})"
        rows.append([
            name, num(r.get("final_loss")), num(r.get("best_loss")), num(r.get("val_loss")), logit,
            big(r.get("max_logz")), num(r.get("mean_abs_logz"), 2), num(r.get("mean_logit"), 2),
            *([num(r.get("max_vio"), 2), num(r.get("dead_experts"), 0)] if moe else []), first, above, verdict,
        ])  # fmt: skip
    return headers, rows


def verdict_lines(summary: Summary) -> str:
    """Each variant's verdict with the checks behind it."""
    lines = []
    for name, v in summary.verdicts.items():
        caveat = (
            " (its outcome checks pass; a mechanism check below does not)"
            if v["verdict"].endswith(CAVEAT)
            else ""
        )
        lines.append(f"{name}: {v['verdict']}{caveat}")
        for c in v.get("checks", []):
            lines.append(f"    {_check_text(c)}")
        for c in v.get("mechanism", []):
            lines.append(f"    mechanism: {_check_text(c)}")
        if v.get("rescue"):
            lines.extend(f"    {line}" for line in rescue_lines(v["rescue"], name, summary.variants))
        lines.extend(f"    {line}" for line in clip_lines(summary.variants.get(name, {})))
        error = summary.variants.get(name, {}).get("error")
        if error:
            lines.append(
                f"    {'stopped' if summary.variants[name].get('status') == 'stopped' else 'error'}: {error}"
            )
    return "\n".join(lines)


def rescue_lines(info: dict[str, Any], name: str, variants: dict[str, dict[str, Any]]) -> list[str]:
    """What rescue variant `name`'s rescues did (its verdict's ``rescue`` entry and the results)."""
    result = variants.get(name, {})
    lines = []
    for r in result.get("rescues", []):
        back = r.get("restored_step")
        where = (
            f"rolled back to step {back}, {r.get('steps_lost', 0)} steps lost"
            if back is not None
            else "no snapshot to roll back to"
        )
        change = r.get("output_change")
        moved = f", output change {change:.2g}" if isinstance(change, int | float) else ""
        lines.append(f"rescue at step {r.get('step')}: {r.get('fix')} switched on, {where}{moved}")
    if len(result.get("rescues", [])) > 1:
        lines.append(f"steps lost in all: {info.get('steps_lost', 0)}")
    other = info.get("compared_with")
    if other is not None:
        theirs = variants.get(other, {}).get("val_loss")
        lines.append(
            f"held-out loss {num(result.get('val_loss'))} vs {num(theirs)} with {other} from the start "
            f"(tolerance {info.get('tolerance', 0):g} nats)"
        )
    return lines


def clip_lines(result: dict[str, Any]) -> list[str]:
    """What qk_clip and the action clip did in one variant (`stabkit.harness.recipes.clipping`)."""
    lines = []
    if result.get("qk_clip_steps") is not None:
        curve = result.get("qk_clip_fraction_curve") or []
        share = result.get("qk_clip_share_curve") or []
        full = next((s for s, f in curve if f >= result.get("qk_clip_heads_fraction", 0) > 0), None)
        by = f" (all of them by step {full})" if full is not None else ""
        quiet = result.get("qk_clip_quiet_step")
        lines.append(
            f"qk_clip: {result.get('qk_clip_heads_fraction', 0):.0%} of heads clipped at least once{by}; "
            f"{result['qk_clip_steps']} steps with a clip, the last at step {quiet}"
        )
        if share:
            lines.append(
                "qk_clip: share of heads clipped per step, by sixth of the run: "
                + ", ".join(f"{v:.0%}" for _, v in share)
            )
        lines.append(
            f"qk_clip: max logit of a head after its first clip {num(result.get('qk_clip_max_after_clip'))}"
        )
    if result.get("clip_steps") is not None:
        lines.append(
            f"clip: {result['clip_steps']} steps clipped (first at step {result.get('clip_first_step')})"
        )
    return lines


def _check_text(c: dict[str, Any]) -> str:
    if c.get("passed") is None:
        return f"{c['check']}: not measured ({c.get('why', '')})"
    return f"{c['check']}: {c['measured']:.4g} -> {'pass' if c['passed'] else 'FAIL'}"


def footer(summary: Summary) -> str:
    """The legend: complete or partial, what "above bigram" means (with the bigram level), what a
    verdict marked * means (only when one is), that max attn logit is before any cap."""
    first: dict[str, Any] = next(iter(summary.variants.values()), {})
    parts = []
    if not summary.complete:
        parts.append("PARTIAL: " + ("interrupted" if summary.interrupted else "not every variant finished"))
    if "bigram_loss" in first:
        parts.append(f"above bigram = val loss non-finite or >= the bigram level {first['bigram_loss']:.3f}")
    parts.append("max attn logit is before any cap")
    legend = "; ".join(parts)
    if any(str(v.get("verdict", "")).endswith(CAVEAT) for v in summary.verdicts.values()):
        legend += "\n" + CAVEAT_LEGEND
    return legend


def group_events(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any], int]]:
    """Consecutive events of the same kind at the same place, as (first, last, count)."""
    groups: list[tuple[dict[str, Any], dict[str, Any], int]] = []
    for e in events:
        if groups:
            first, last, count = groups[-1]
            if (first.get("kind"), first.get("where")) == (e.get("kind"), e.get("where")) and e.get(
                "step", 0
            ) - last.get("step", 0) <= 1:
                groups[-1] = (first, e, count + 1)
                continue
        groups.append((e, e, 1))
    return groups


def events_text(summary: Summary, limit: int = 20, progress: Progress | None = None) -> str:
    """Every variant's events (step, kind, where, message) and the distinct advice they carry
    (bytes of the logs read reported to `progress`, see `event_log`)."""
    lines = []
    for name, r in summary.variants.items():
        if progress is not None:
            progress.begin(name)
        events = events_of(r, progress)
        lines.append(f"{name}: {len(events)} event(s)")
        groups = group_events(events)
        for first, last, count in groups[:limit]:
            steps = (
                f"step {first.get('step')}"
                if count == 1
                else f"steps {first.get('step')}-{last.get('step')} (x{count})"
            )
            lines.append(
                f"    {steps}: [{first.get('kind')}] {first.get('where')}: {first.get('message', '')}"
            )
        if len(groups) > limit:
            lines.append(f"    ... {len(groups) - limit} more in {Path(r.get('logdir', '')) / LOG_NAME}")
        shown = {id(first) for first, _, _ in groups[:limit]}
        for e in (e for e in events if e.get("kind") == "rescue" and id(e) not in shown):  # past `limit`
            lines.append(f"    rescue at step {e.get('step')} ({e.get('where')}): {e.get('message', '')}")
        advice = sorted({e.get("advice", "") for e in events if e.get("advice")})
        for a in advice:
            lines.append(f"    advice: {a}")
    return "\n".join(lines)


def sweep_tables(summary: Summary) -> str:
    """The sweep's held-out loss and max attention logit per LR, then the LR-sensitivity table."""
    lrs = [f"{lr:g}" for lr in summary.lrs or []]
    loss_rows, logit_rows, sens_rows = [], [], []
    for name, v in summary.variants.items():
        runs = v.get("runs", {})
        loss_rows.append([name, *(num(runs.get(lr, {}).get("val_loss")) for lr in lrs)])
        logit_rows.append([name, *(big(runs.get(lr, {}).get("max_attn_logit")) for lr in lrs)])
        verdict = summary.verdicts.get(name, {}).get("verdict", v.get("status", ""))
        sens_rows.append(
            [
                name,
                num(v.get("init_loss")),
                num(v.get("best_grid_loss")),
                num(v.get("lr_sensitivity")),
                num(v.get("lr_sensitivity_high")),
                verdict,
            ]
        )
    lo, hi = summary.high or [math.nan, math.nan]
    first: dict[str, Any] = next(iter(summary.variants.values()), {})
    parts = [
        "final held-out loss by peak LR",
        table(["variant", *lrs], loss_rows),
        "",
        "max attention logit (before any cap) by peak LR",
        table(["variant", *lrs], logit_rows),
        "",
        f"LR sensitivity E[min(l(lr), l0) - l*], l* = {num(first.get('best_loss_all'))} (best on the grid over all variants)",
        table(["variant", "l0 (init)", "best", "whole grid", f"[{lo:g}, {hi:g}]", "verdict"], sens_rows),
    ]
    return "\n".join(parts)

"""What the experiment-tracker sinks (Weights & Biases, MLflow) share: their error, the import that
names the extra to install, the run's config as parameters, metric names, event and audit rows.

Runs when a tracker sink is built (at `attach`, on the writing rank: `stabkit.distributed.rank_sinks`)
and on each write. A tracker that cannot be reached, refuses a write or is not installed raises
`TrackerError`, an OSError: `SinkSet` then warns once and switches that sink off — even with
`MonitorConfig.strict`, since it is the environment failing, not stabkit — and training goes on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import re
import socket
import threading
import urllib.parse
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..events import SEVERITIES, Event
from .jsonl import json_safe

STEP_KEY = "stabkit/step"
"""The monitor's step, logged with every row: the x-axis of stabkit's charts in a tracker (W&B's own
step counter is shared with the user's logging, so stabkit never sets it)."""
EVENT_COLUMNS = (
    "step",
    "severity",
    "kind",
    "where",
    "value",
    "threshold",
    "message",
    "advice",
    "incident",
    "details",
)
"""Columns of the W&B events table (one row per event; ``incident`` is its incident's id)."""
INCIDENT_COLUMNS = ("id", "severity", "first_step", "last_step", "kinds", "members", "first", "headline")
"""Columns of the incidents table (W&B) and the keys of ``stabkit/incidents.json`` (MLflow): one row
per incident, as it last stood."""
AUDIT_COLUMNS = ("severity", "rule", "where", "evidence", "why", "fix")
"""Columns of the audit table: one row per finding."""
NOT_PARAMS = ("wandb", "mlflow")
"""MonitorConfig fields left out of the run's parameters (where it writes, not what it measures)."""
MAX_PARAM = 500
"""Longest parameter value written (MLflow servers before 2.x refuse longer ones); longer is cut."""


class TrackerError(OSError):
    """A tracker could not be reached, refused a write, or is not installed."""


def warn_late(label: str, exc: BaseException) -> None:
    """Say once that a tracker failed after `detach` handed it its last writes (from its writer thread:
    no `SinkSet` hears of it any more)."""
    warnings.warn(
        f"stabkit: cannot write {label} ({type(exc).__name__}: {exc}); it failed after detach, with "
        "writes still queued — the JSONL log and TensorBoard hold every logged step and event",
        RuntimeWarning,
        stacklevel=2,
    )


def require(module: str, extra: str) -> Any:
    """Import a tracker's package, or raise TrackerError saying which stabkit extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerError(
            f"the {module} package is not installed ({exc}): pip install 'stabkit[{extra}]'"
        ) from exc


@contextlib.contextmanager
def translated(errors: tuple[type[BaseException], ...], what: str) -> Iterator[None]:
    """Re-raise a tracker library's own errors (`errors`) as TrackerError naming `what` failed."""
    try:
        yield
    except errors as exc:
        raise TrackerError(f"{what}: {type(exc).__name__}: {exc}") from exc


def plain(value: Any) -> Any:
    """`value` as JSON types: dataclasses as dicts of their public fields, sets sorted, callables by name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.init and not f.name.startswith("_")
        }
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, set | frozenset):
        return sorted(plain(v) for v in value)
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if callable(value):
        return getattr(value, "__qualname__", None) or repr(value)
    return repr(value)


def run_params(config: Any) -> dict[str, Any]:
    """The monitor's settings (`MonitorConfig` with its `DetectConfig`) as nested JSON types, without
    the tracker switches: a W&B config section, or MLflow parameters once flattened."""
    if config is None:
        return {}
    params = plain(config)
    for name in NOT_PARAMS:
        params.pop(name, None)
    return params


def flat_params(nested: Mapping[str, Any], prefix: str = "stabkit") -> dict[str, str]:
    """`{"detect": {"sync": None}}` -> `{"stabkit.detect.sync": "None"}`; lists as JSON; values cut
    to `MAX_PARAM` characters. An empty dict is kept as "{}"."""
    out: dict[str, str] = {}
    for key, value in nested.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name))
            continue
        text = json.dumps(value) if isinstance(value, list | dict) else str(value)
        out[name] = text[:MAX_PARAM]
    return out


_BAD = re.compile(r"[^/\w.\- ]")


def safe_key(name: str, limit: int = 250) -> str:
    """A metric or parameter name every tracker takes: characters other than letters, digits and
    ``_-. /`` become ``_``; empty, ``.`` and ``..`` path parts (``act//rms`` for a root module) become
    ``_``; at most `limit` characters."""
    parts = [_BAD.sub("_", p) for p in name.split("/")]
    parts = ["_" if p in ("", ".", "..") else p for p in parts]
    return "/".join(parts)[:limit]


def chart_group(name: str) -> str:
    """The glob a metric's chart settings are declared for: ``act/*`` for ``act/blocks.0/rms``,
    the name itself for a top-level metric (``loss``)."""
    return name.split("/", 1)[0] + "/*" if "/" in name else name


def metric_prefix(prefix: str | None, joined: bool) -> str:
    """The option as given, else "" in a run stabkit started and "stabkit/" in a joined one."""
    if prefix is not None:
        return prefix
    return "stabkit/" if joined else ""


def run_name(name: str | None, logdir: str | Path | None) -> str | None:
    """The run's name: the option, else the logdir's folder name (``runs/exp1`` -> ``exp1``)."""
    if name:
        return name
    return Path(logdir).name or None if logdir is not None else None


def event_row(event: Event) -> list[Any]:
    """One event in `EVENT_COLUMNS` order (details as JSON text; incident -1 when it has none)."""
    details = json.dumps(json_safe(event.details), default=str) if event.details else ""
    incident = event.details.get("incident") if event.details else None
    return [
        int(event.step),
        str(getattr(event, "severity", "warning")),
        event.kind,
        str(event.where),
        float(event.value),
        float(event.threshold),
        event.message,
        event.advice,
        int(incident) if isinstance(incident, int | float) else -1,
        details,
    ]


def incident_row(record: Mapping[str, Any]) -> list[Any]:
    """An ``incident`` record (`stabkit.incidents.Incident.to_dict`) in `INCIDENT_COLUMNS` order
    (kinds joined by commas)."""
    return [
        int(record.get("id", -1)),
        str(record.get("severity", "")),
        int(record.get("first_step", -1)),
        int(record.get("last_step", -1)),
        ", ".join(map(str, record.get("kinds", []))),
        int(record.get("members", 0)),
        str(record.get("first", "")),
        str(record.get("headline", "")),
    ]


def severity_counts(events: list[Event]) -> dict[str, int]:
    """How many events of each severity (every one of `SEVERITIES`, zeros included)."""
    counts = dict.fromkeys(SEVERITIES, 0)
    for event in events:
        severity = str(getattr(event, "severity", "warning"))
        counts[severity] = counts.get(severity, 0) + 1
    return counts


CONNECT_BUDGET = 3.0
"""Seconds a tracker's server gets to accept a connection at `attach` before it is called unreachable."""


def endpoint_problem(url: str | None, budget: float = CONNECT_BUDGET) -> str | None:
    """Why an http(s) `url`'s server cannot be reached — ``connection refused``, ``the name 'x' does
    not resolve``, ``no answer within 3 s`` — or None when a TCP connection opens (or `url` is not
    http(s)). Takes at most `budget` seconds (name lookup included: it runs on a helper thread)."""
    parsed = urllib.parse.urlsplit(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return None
    host = parsed.hostname
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return f"bad port in {url!r}"
    found: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=budget).close()
            found.append(None)
        except ConnectionRefusedError:
            found.append("connection refused")
        except socket.gaierror as exc:
            found.append(f"the name {host!r} does not resolve ({exc.strerror or exc})")
        except TimeoutError:
            found.append(f"no answer within {budget:g} s")
        except OSError as exc:
            found.append(f"unreachable: {exc.strerror or exc}")

    helper = threading.Thread(target=connect, name="stabkit endpoint check", daemon=True)
    helper.start()
    helper.join(budget)
    return found[0] if found else f"no answer within {budget:g} s"


def audit_rows(report: Mapping[str, Any]) -> list[list[str]]:
    """The audit report's findings (`Report.to_dict()`), one row each in `AUDIT_COLUMNS` order."""
    rows = []
    for f in report.get("findings", []):
        rows.append(
            [
                str(f.get("severity", "")),
                str(f.get("rule", "")),
                ", ".join(map(str, f.get("where", []))),
                json.dumps(f.get("evidence", {}), default=str),
                str(f.get("why", "")),
                ", ".join(map(str, f.get("fix", []))),
            ]
        )
    return rows


def note_path(tag: str, suffix: str = ".md") -> str:
    """Where a text note goes among a run's files: ``stabkit/audit`` -> ``stabkit/audit.md``; a tag
    of the user's (``notes``) goes under ``stabkit/`` too."""
    key = safe_key(tag)
    return (key if key.startswith("stabkit/") else f"stabkit/{key}") + suffix


def notes_text(entries: list[tuple[int, str]]) -> str:
    """A tag's notes as one file: the text itself when written once, else one section per step."""
    if len(entries) == 1:
        return entries[0][1]
    return "\n\n".join(f"## step {step}\n\n{text}" for step, text in entries)

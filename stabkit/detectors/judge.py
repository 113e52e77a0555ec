"""`Judge`: the registered detectors of one run, fed host values — no model, no tensors.

The orchestration (`stabkit.decisions`) feeds it a small per-step host copy (kinds decided every
step) or the rows of each log interval's host copy (warn-only kinds). A test feeds it plain rows::

    judge = Judge(DetectorContext(config=DetectConfig(), attention_paths=("blocks.0.attn",)))
    events = judge.rows([(step, {"loss": 2.1, ...}), ...])

Every event it returns carries its advice (`stabkit.detectors.advice.advise`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..events import Event
from ..plugins import DETECTORS
from .advice import advise
from .base import Detector, DetectorContext

STATE_VERSION = 2


WANTED_KEPT = 64
"""Sets of row names whose wanted names `Judge` remembers (a run has a few: sampled, unsampled...)."""


class Judge:
    """The detectors switched on in `ctx.config`, in registry order."""

    def __init__(self, ctx: DetectorContext) -> None:
        self.ctx = ctx
        self.detectors: dict[str, Detector] = {
            cls.kind: cls(ctx) for cls in DETECTORS.classes() if ctx.config.runs(cls.kind)
        }
        self._reported: dict[int, set[str]] = {}
        self._wanted: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        """The names each detector reads, per set of row names (sampled and unsampled rows alternate)."""

    def __getitem__(self, kind: str) -> Detector:
        return self.detectors[kind]

    def kinds(self, per_step: bool | None = None) -> list[str]:
        """Kinds of the running detectors; only those decided every step (True) or at the log
        interval (False) when `per_step` is given."""
        cfg = self.ctx.config
        return [k for k in self.detectors if per_step is None or cfg.needs_sync(k) == per_step]

    def wanted(
        self, names: Iterable[str], kinds: Iterable[str], before_update: bool | None = None
    ) -> list[str]:
        """The names some detector of `kinds` reads (only those judged before / after the update when
        `before_update` is given), in the given order."""
        dets = [self.detectors[k] for k in kinds]
        out = []
        for name in names:
            for det in dets:
                if det.wants(name) and (
                    before_update is None or det.judged_before_update(name) == before_update
                ):
                    out.append(name)
                    break
        return out

    def judge(
        self, step: int, values: Mapping[str, float], kinds: Iterable[str] | None = None
    ) -> tuple[list[Event], dict[str, float]]:
        """Events (advised) and extra series of `step` from the detectors of `kinds` (all when None)."""
        events: list[Event] = []
        extra: dict[str, float] = {}
        names = tuple(values)
        for kind in self.kinds() if kinds is None else kinds:
            det = self.detectors[kind]
            mine = {n: values[n] for n in self._wanted_by(det, names)}
            if not mine:
                continue
            seen = det.observe(step, mine)
            extra.update(seen.series)
            events += [self.advise(e) for e in seen.events if not self.redundant(e, det)]
        return events, extra

    def _wanted_by(self, det: Detector, names: tuple[str, ...]) -> list[str]:
        """The `names` `det` reads, remembered per detector and set of names (a run's rows carry the
        same few sets of names step after step — sampled and unsampled ones, ~300 names in full
        mode — and each is judged at every step)."""
        key = (det.kind, names)
        mine = self._wanted.get(key)
        if mine is None:
            if len(self._wanted) >= WANTED_KEPT:  # names that vary row to row: stay bounded
                self._wanted.clear()
            mine = self._wanted[key] = [n for n in names if det.wants(n)]
        return mine

    def rows(
        self, rows: list[tuple[int, dict[str, float]]], kinds: Iterable[str] | None = None
    ) -> list[Event]:
        """Judge each (step, row) in order; extra series are added to the rows. Returns the events."""
        events: list[Event] = []
        chosen = list(self.kinds() if kinds is None else kinds)
        for step, row in rows:
            found, extra = self.judge(step, row, chosen)
            for event in found:
                self.note(event)
            events += found
            row.update(extra)
        return events

    def rewind(self, step: int) -> None:
        """Model and optimizer were restored to before step `step` (rollback, rescue): every
        detector forgets what it saw after it (`Detector.rewind`)."""
        for det in self.detectors.values():
            det.rewind(step)
        self._reported = {s: k for s, k in self._reported.items() if s < step}

    def advise(self, event: Event) -> Event:
        """Fill the event's advice from the detector of its kind (none for an unknown kind)."""
        det = self.detectors.get(event.kind)
        if det is None and event.kind in DETECTORS:
            det = DETECTORS.load(event.kind)(self.ctx)
        return advise(event, det) if det is not None and det.advice else event

    def note(self, event: Event) -> None:
        """Remember that `event` was reported (for `Detector.quiet_after`)."""
        self._reported.setdefault(event.step, set()).add(event.kind)
        if len(self._reported) > 64:
            for step in sorted(self._reported)[:-32]:
                del self._reported[step]

    def reported(self, step: int, kind: str) -> bool:
        """True when an event of `kind` was noted at `step`."""
        return kind in self._reported.get(step, set())

    def redundant(self, event: Event, det: Detector) -> bool:
        """True when an event of a kind in ``det.quiet_after`` was reported at the same step."""
        return bool(set(det.quiet_after) & self._reported.get(event.step, set()))

    def state_dict(self) -> dict[str, Any]:
        """Every detector's state, by kind."""
        return {"version": STATE_VERSION, "detectors": {k: d.state_dict() for k, d in self.detectors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (version 1 held only 'spike' and 'drift' at the top level)."""
        version = state.get("version")
        if version == 1:
            states = {k: state[k] for k in ("spike", "drift") if k in state}
        elif version == STATE_VERSION:
            states = state["detectors"]
        else:
            raise ValueError(
                f"detector state version {version!r} is not {STATE_VERSION}; it was saved by another stabkit version"
            )
        for kind, det_state in states.items():
            if kind in self.detectors:
                self.detectors[kind].load_state_dict(det_state)

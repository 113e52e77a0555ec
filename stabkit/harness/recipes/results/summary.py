"""`Summary`: what `stabkit run` (`run_recipe`) and `stabkit sweep` (`run_sweep`) return and write.

One type for both commands (and for `stabkit report`, which reads it back with `Summary.from_dict`
from ``summary.json`` / ``sweep.json``, or builds one of kind ``"log"`` from a monitored run's log).
`Summary.to_dict` is the JSON on disk: the header (`describe` of the runner), the sweep's grid
fields for a sweep, then the state and the per-variant results and verdicts; other fields that are
None are left out, as they were absent before (e.g. ``seconds`` before the first variant ends,
``stopped_by`` unless a SIGTERM stopped the run, ``plot`` except for a sweep's final summary).

Each variant's result and verdict stay plain dicts (``variants[name]["val_loss"]``,
``verdicts[name]["verdict"]``): they are the workers' results and `Verdict.to_dict`, shared with
the checks that read them by metric name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

KINDS = ("run", "sweep", "log")
HEADER = (
    "processes", "recipe", "description", "source", "size", "device", "seed", "steps", "data",
    "model", "train", "fault", "expect", "criteria", "variant_roles",
)  # fmt: skip
"""The header fields (`runner.describe`): all written when the summary has one (``fault`` may be
None there), none for a "log" summary."""


@dataclass
class Summary:
    """A recipe run's or sweep's settings, state, results and verdicts."""

    kind: str
    """"run" (`stabkit run`), "sweep" (`stabkit sweep`) or "log" (read from monitored runs' logs)."""
    # ---- the header (`runner.describe`); absent from a "log" summary
    processes: int | None = None
    """Processes per variant (DDP world size; 1 without DDP)."""
    recipe: str = ""
    description: str | None = None
    source: str | None = None
    size: str | None = None
    device: str | None = None
    seed: int | None = None
    steps: int | None = None
    data: str | None = None
    model: dict[str, Any] | None = None
    arch: dict[str, Any] | None = None
    """On a user's model (``--model hf:llama``): its spec, options, skipped variants and notes
    (`stabkit.harness.recipes.arch.Adaptation`); absent for the reference GPT."""
    train: dict[str, Any] | None = None
    fault: dict[str, Any] | None = None
    expect: dict[str, str] | None = None
    criteria: dict[str, Any] | None = None
    variant_roles: dict[str, str] | None = None
    # ---- a sweep's grid
    lrs: list[float] | None = None
    high: list[float] | None = None
    convention: str | None = None
    # ---- state
    started: str | None = None
    complete: bool = False
    interrupted: bool = False
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per variant (in the recipe's order): the worker's result, or a sweep's per-LR table."""
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per variant: `Verdict.to_dict()`."""
    seconds: float | None = None
    stopped_by: str | None = None
    """"SIGTERM" when a SIGTERM stopped the run."""
    plot: str | None = None
    """A sweep's plot path (or why there is none)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of a read-back file this type does not know (kept, and written back last)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Summary.kind must be one of {KINDS}, got {self.kind!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON written as ``summary.json`` / ``sweep.json``: the header (when there is one),
        then every other field that is not None."""
        out: dict[str, Any] = {}
        header = self.processes is not None
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is not None or (header and f.name in HEADER):
                out[f.name] = value
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        """A summary read back (missing keys take their defaults, but a file that does not say is
        complete; unknown keys go to `extra`)."""
        if not isinstance(data, dict):
            raise ValueError(f"a summary is a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        given = {k: v for k, v in data.items() if k in known}
        given.setdefault("kind", "run")
        given.setdefault("complete", True)  # what readers assumed of a file that does not say
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**given, extra=extra)

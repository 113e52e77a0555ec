"""Rescue variants (role ``rescue``): the baseline's settings, with stabkit allowed to act.

A ``[variants.<name>]`` table with ``role = "rescue"`` (the default role of a variant named
``rescue``) trains exactly what the baseline trains (its train settings, interventions and fault),
with the detect action ``rescue`` (`stabkit.actions.rescue`) added for every event kind whose advice
can name a fix that goes on mid-run (`rescue_kinds`: non-finite values in attention or at the
output, drift of the attention logits or of log Z, attention-entropy collapse). Its own ``detect``
table goes over the baseline's (e.g. ``options.rollback.snapshot_every``, ``options.rescue.lr_factor``).

`rescue_quantities` reads what happened from the run's events (kind ``rescue``): each rescue's step,
fix, restored step and steps lost, or the failure; `stabkit.harness.recipes.verdict.judge` turns
that into "rescued" / "not rescued" (against the variant that had the fix from the start) /
"no rescue happened" / "rescue failed at step N".
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ....detect_config import DetectConfig

RESCUE_TOLERANCE = 0.1
"""Default ``tolerance`` of a rescue variant: its final held-out loss may exceed the fixed-from-the-
start variant's by at most this many nats (half the 0.2 the built-in recipes allow a fix against
the reference run)."""


def rescue_kinds() -> tuple[str, ...]:
    """Event kinds (detector names) with an advice row that names a fix a rescue can switch on."""
    from ....actions.rescue import MIDRUN
    from ....plugins import DETECTORS

    kinds = []
    for name in DETECTORS.names():
        cls = DETECTORS.load(name)
        if any(set(row.interventions) & set(MIDRUN) for row in cls.advice.values()):
            kinds.append(name)
    return tuple(kinds)


def with_rescue(detect: DetectConfig) -> DetectConfig:
    """`detect` with the action ``rescue`` added (after its own actions) for every `rescue_kinds` kind."""
    actions: dict[str, Any] = dict(detect.actions)
    for kind in rescue_kinds():
        own = tuple(actions.get(kind, ("warn",)))
        actions[kind] = own if "rescue" in own else (*own, "rescue")
    return replace(detect, actions=actions)


def rescue_quantities(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the rescues of a run did, from its events of kind ``rescue`` (`Event.to_dict` rows):

    ``rescues`` (each rescue: step, fix, restored_step, steps_lost, output_change, message),
    ``rescue_count``, ``rescue_fixes`` (in order, distinct), ``rescue_step`` (the first),
    ``steps_lost`` (their sum), and ``rescue_failed`` (the failure: step, message) or None.
    """
    done: list[dict[str, Any]] = []
    failed: dict[str, Any] | None = None
    for e in events:
        if e.get("kind") != "rescue":
            continue
        d = e.get("details", {}) or {}
        if d.get("failed"):
            failed = failed or {"step": e.get("step"), "message": e.get("message", "")}
            continue
        done.append(
            {
                "step": d.get("step", e.get("step")),
                "fix": d.get("fix", e.get("where")),
                "restored_step": d.get("restored_step"),
                "steps_lost": int(d.get("steps_lost") or 0),
                "output_change": d.get("output_change"),
                "message": e.get("message", ""),
            }
        )
    return {
        "rescues": done,
        "rescue_count": len(done),
        "rescue_fixes": list(dict.fromkeys(r["fix"] for r in done)),
        "rescue_step": done[0]["step"] if done else None,
        "steps_lost": sum(r["steps_lost"] for r in done),
        "rescue_failed": failed,
    }

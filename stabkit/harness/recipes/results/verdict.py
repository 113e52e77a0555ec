"""Verdicts: whether the baseline reproduced the instability and whether each intervention fixed it.

Evaluated in the parent after each finished variant (so a partial summary has partial verdicts)
from the variants' results. Honest by construction: an intervention is only called *fixed* when
the baseline *reproduced* the instability; otherwise it is *not reproduced at this size*, and its
checks are still shown. Checks that cannot be measured make the verdict *undetermined*. A verdict
never contradicts the variant's own checks: when its fixed checks pass but one of its mechanism
checks (how the intervention is meant to work, e.g. QK-Clip holding each head near τ) fails or
could not be measured, it is "fixed*" (`FIXED_CAVEAT`), not *fixed* — and a rescue "rescued*".

A rescue variant (role ``rescue``: the baseline with stabkit's action 'rescue') is judged against the
variant that had the fix from the start — the intervention whose interventions are exactly the
fixes its rescues switched on (read from its ``rescue`` events): *rescued* when its final held-out
loss is within the variant's tolerance of that one, else *not rescued*; *no rescue happened* when
stabkit never acted; *rescue failed at step N* when the same trouble came back and stabkit stopped
the run; *not judged* when the recipe has no such variant (or it did not finish).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..spec.checks import VARIANT, Check
from ..spec.rescue import RESCUE_TOLERANCE

REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"
FIXED, NOT_FIXED, NOT_AT_SIZE = "fixed", "not fixed", "not reproduced at this size"
UNDETERMINED, REFERENCE = "undetermined", "reference"
RESCUED, NOT_RESCUED, NO_RESCUE = "rescued", "not rescued", "no rescue happened"
SHOWN, NOT_SHOWN = "shown", "not shown"
"""A contrast variant's verdict (role ``contrast``: the baseline under other settings, showing what the
instability costs there): its own checks (its ``mechanism`` table) all pass, or one fails."""
CAVEAT = "*"
"""Marks a verdict (`FIXED_CAVEAT`, `RESCUED_CAVEAT`) whose outcome checks pass while one of the
variant's own mechanism checks fails or could not be measured."""
FIXED_CAVEAT, RESCUED_CAVEAT = FIXED + CAVEAT, RESCUED + CAVEAT
CAVEAT_LEGEND = (
    "* = its fixed (rescue) checks pass but one of its own mechanism checks fails or was not "
    "measured: the loss was fixed, not (only) the way the intervention is meant to fix it"
)
"""What `FIXED_CAVEAT` / `RESCUED_CAVEAT` mean, for the table's legend."""


@dataclass
class CheckResult:
    """One check on one variant."""

    check: str
    """The check in words (`Check.describe`)."""
    measured: float | None
    """The compared number (after vs / how); None when it could not be measured."""
    passed: bool | None
    """None when not measurable."""
    why: str = ""
    """Why it could not be measured."""

    def text(self) -> str:
        if self.passed is None:
            return f"{self.check}: not measured ({self.why})"
        return f"{self.check}: {self.measured:.4g} -> {'pass' if self.passed else 'FAIL'}"


@dataclass
class Verdict:
    """The verdict on one variant with the checks behind it."""

    variant: str
    role: str
    verdict: str
    checks: list[CheckResult] = field(default_factory=list)
    mechanism: list[CheckResult] = field(default_factory=list)
    rescue: dict[str, Any] | None = None
    """A rescue variant's: fixes, first step, steps lost, restored steps, the variant compared with,
    the tolerance, and the step of a failure (None for other roles)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if self.rescue is None:
            del out["rescue"]
        return out


def quantity(result: Mapping[str, Any], check: Check) -> float:
    """The variant's own number for `check` (NaN when absent)."""
    if check.is_history:
        value = result.get("aggregates", {}).get(f"{check.agg}({check.metric})", math.nan)
    elif check.metric.startswith("events/"):
        value = result.get(check.metric, 0.0 if result.get("status") == "done" else math.nan)
    else:
        value = result.get(check.metric, math.nan)
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def measure(
    check: Check, name: str, results: Mapping[str, Mapping[str, Any]], roles: Mapping[str, str]
) -> CheckResult:
    """Evaluate `check` on variant `name` given every variant's result."""
    own = quantity(results[name], check)
    if math.isnan(own):
        return CheckResult(check.describe(), None, None, f"no value of {check.metric}")
    if check.vs is not None:
        if check.vs == "best":
            values = [quantity(r, check) for r in results.values()]
            finite = [v for v in values if math.isfinite(v)]
            other = min(finite) if finite else math.nan
        else:
            named = check.vs[len(VARIANT) :] if check.vs.startswith(VARIANT) else None
            names = (
                [named]
                if named is not None
                else [n for n, role in roles.items() if role == check.vs and n in results]
            )
            other = quantity(results[names[0]], check) if names and names[0] in results else math.nan
        if math.isnan(other):
            return CheckResult(check.describe(), None, None, f"no {check.vs} value to compare with")
        if check.how == "ratio":
            own = own / other if other != 0 else math.copysign(math.inf, own)
        else:
            own = own - other
    return CheckResult(check.describe(), own, check.passes(own))


def _all(results: Sequence[CheckResult]) -> bool | None:
    if not results:
        return None
    if any(r.passed is None for r in results):
        return None
    return all(r.passed for r in results)


def judge(
    order: Sequence[str],
    roles: Mapping[str, str],
    results: Mapping[str, Mapping[str, Any]],
    reproduced: Sequence[Check],
    fixed: Mapping[str, Sequence[Check]],
    mechanism: Mapping[str, Sequence[Check]],
    tolerance: Mapping[str, float] | None = None,
) -> dict[str, Verdict]:
    """Verdicts for every variant in `order` that has a result.

    `fixed[name]` are the checks of intervention `name`; `mechanism[name]` are reported whatever
    the verdict; `tolerance[name]` is rescue variant `name`'s (`judge_rescue`). Variants not finished
    (status other than done) get their status as verdict ("stopped at step N" when stabkit stopped
    them), a rescue variant whose rescue failed "rescue failed at step N".
    """
    done = {n: r for n, r in results.items() if r.get("status") == "done"}
    baseline = next((n for n in order if roles[n] == "baseline"), None)
    base_verdict = UNDETERMINED
    out: dict[str, Verdict] = {}
    if baseline is not None and baseline in done:
        checks = [measure(c, baseline, done, roles) for c in reproduced]
        ok = _all(checks)
        base_verdict = UNDETERMINED if ok is None else (REPRODUCED if ok else NOT_REPRODUCED)
        if not reproduced:
            base_verdict = UNDETERMINED
    for name in order:
        if name not in results:
            continue
        role = roles[name]
        status = results[name].get("status", "")
        if role == "rescue" and status in ("done", "stopped"):
            mech = [measure(c, name, done, roles) for c in mechanism.get(name, ())]
            tol = (tolerance or {}).get(name, RESCUE_TOLERANCE)
            out[name] = judge_rescue(name, order, roles, results, tol, mech)
            continue
        if name not in done:
            stopped = results[name].get("stopped") or {}
            verdict = (
                f"stopped at step {stopped['step']}" if status == "stopped" and "step" in stopped else status
            )
            out[name] = Verdict(name, role, verdict or "not run")
            continue
        mech = [measure(c, name, done, roles) for c in mechanism.get(name, ())]
        if role == "baseline":
            checks = [measure(c, name, done, roles) for c in reproduced]
            out[name] = Verdict(name, role, base_verdict, checks, mech)
        elif role == "reference":
            out[name] = Verdict(name, role, REFERENCE, [], mech)
        elif role == "contrast":
            ok = _all(mech)
            shown = UNDETERMINED if ok is None else (SHOWN if ok else NOT_SHOWN)
            out[name] = Verdict(name, role, shown, mech, [])
        else:
            checks = [measure(c, name, done, roles) for c in fixed.get(name, ())]
            ok = _all(checks)
            if base_verdict == REPRODUCED:
                verdict = UNDETERMINED if ok is None else (FIXED if ok else NOT_FIXED)
                verdict = with_caveat(verdict, mech)
            elif base_verdict == NOT_REPRODUCED:
                verdict = NOT_AT_SIZE
            else:
                verdict = (
                    f"{UNDETERMINED} (baseline {results.get(baseline or '', {}).get('status', 'missing')})"
                )
                if baseline in done:
                    verdict = f"{UNDETERMINED} (baseline undetermined)"
            out[name] = Verdict(name, role, verdict, checks, mech)
    return out


def with_caveat(verdict: str, mechanism: Sequence[CheckResult]) -> str:
    """`verdict` marked with `CAVEAT` when it is fixed or rescued while a mechanism check did not
    pass (failed, or could not be measured); any other verdict unchanged."""
    if verdict in (FIXED, RESCUED) and any(m.passed is not True for m in mechanism):
        return verdict + CAVEAT
    return verdict


def judge_rescue(
    name: str,
    order: Sequence[str],
    roles: Mapping[str, str],
    results: Mapping[str, Mapping[str, Any]],
    tolerance: float,
    mechanism: list[CheckResult],
) -> Verdict:
    """The verdict on rescue variant `name` (status done or stopped), from its rescue quantities
    (`stabkit.harness.recipes.rescue.rescue_quantities`) and the fixed-from-the-start variant."""
    r = results[name]
    rescues = list(r.get("rescues") or [])
    fixes = list(r.get("rescue_fixes") or dict.fromkeys(x.get("fix") for x in rescues))
    failed = r.get("rescue_failed")
    info: dict[str, Any] = {
        "fixes": fixes,
        "step": rescues[0].get("step") if rescues else None,
        "steps_lost": int(sum(x.get("steps_lost") or 0 for x in rescues)),
        "restored_steps": [x.get("restored_step") for x in rescues],
        "tolerance": tolerance,
        "compared_with": None,
        "failed_at": None,
    }

    def verdict(text: str, checks: Sequence[CheckResult] = ()) -> Verdict:
        return Verdict(name, "rescue", text, list(checks), mechanism, info)

    if failed:
        info["failed_at"] = failed.get("step")
        return verdict(f"rescue failed at step {failed.get('step')}")
    if r.get("status") == "stopped":
        return verdict(f"stopped at step {(r.get('stopped') or {}).get('step')}")
    if not rescues:
        return verdict(NO_RESCUE)
    wanted = set(fixes)
    same = [
        n
        for n in order
        if n in results
        and roles.get(n) == "intervention"
        and set(results[n].get("interventions") or {}) == wanted
    ]
    label = " + ".join(fixes)
    if not same:
        return verdict(f"not judged: no {label} variant to compare with")
    other = same[0]
    info["compared_with"] = other
    if results[other].get("status") != "done":
        return verdict(f"not judged: the {other} variant {results[other].get('status', 'did not run')}")
    own, theirs = _float(r.get("val_loss")), _float(results[other].get("val_loss"))
    if not math.isfinite(theirs):
        return verdict(f"not judged: the {other} variant has no finite held-out loss")
    diff = own - theirs if math.isfinite(own) else math.inf
    check = CheckResult(f"val_loss − {other} <= {tolerance:g}", diff, diff <= tolerance)
    return verdict(with_caveat(RESCUED if check.passed else NOT_RESCUED, mechanism), [check])


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan

"""Verdicts: whether the baseline reproduced the instability and whether each intervention fixed it.

Evaluated in the parent after each finished variant (so a partial summary has partial verdicts)
from the variants' results. Honest by construction: an intervention is only called *fixed* when
the baseline *reproduced* the instability; otherwise it is *not reproduced at this size*, and its
checks are still shown. Checks that cannot be measured make the verdict *undetermined*.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .checks import Check

REPRODUCED, NOT_REPRODUCED = "reproduced", "not reproduced"
FIXED, NOT_FIXED, NOT_AT_SIZE = "fixed", "not fixed", "not reproduced at this size"
UNDETERMINED, REFERENCE = "undetermined", "reference"


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
            names = [n for n, role in roles.items() if role == check.vs and n in results]
            other = quantity(results[names[0]], check) if names else math.nan
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
) -> dict[str, Verdict]:
    """Verdicts for every variant in `order` that has a result.

    `fixed[name]` are the checks of intervention `name`; `mechanism[name]` are reported whatever
    the verdict. Variants not finished (status other than done) get their status as verdict.
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
        if name not in done:
            out[name] = Verdict(name, role, status or "not run")
            continue
        mech = [measure(c, name, done, roles) for c in mechanism.get(name, ())]
        if role == "baseline":
            checks = [measure(c, name, done, roles) for c in reproduced]
            out[name] = Verdict(name, role, base_verdict, checks, mech)
        elif role == "reference":
            out[name] = Verdict(name, role, REFERENCE, [], mech)
        else:
            checks = [measure(c, name, done, roles) for c in fixed.get(name, ())]
            ok = _all(checks)
            if base_verdict == REPRODUCED:
                verdict = UNDETERMINED if ok is None else (FIXED if ok else NOT_FIXED)
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

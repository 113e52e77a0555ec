"""The CI subset of the alarm benchmark (`stabkit alarms --quick`'s corpus part): the cheapest healthy
configurations × 100 steps raise no event of severity warning or above, and loss spikes planted in
two of them (×20 and ×5, early and late) are each found within `SPIKE_TOLERANCE` steps.

One core, about a minute. These are the issue's acceptance criteria for the detectors: a failure here
is a false alarm or a missed spike, printed with its evidence."""

from __future__ import annotations

import pytest

from stabkit.harness.alarms.bench import QUICK_STEPS, planted_spikes
from stabkit.harness.alarms.corpus import select
from stabkit.harness.alarms.runner import run_config
from stabkit.harness.alarms.stats import SPIKE_TOLERANCE, is_warning, spike_finder

CI = select(tag="ci")


def show(events: list[dict[str, object]]) -> str:
    return "\n".join(
        f"  step {e['step']} {e['kind']}/{e['severity']} at {e['where']}: {e['message']}" for e in events
    )


@pytest.mark.parametrize("cfg", CI, ids=[c.name for c in CI])
def test_healthy_run_raises_no_warning(cfg: object) -> None:
    out = run_config(cfg, steps=QUICK_STEPS)  # type: ignore[arg-type]
    assert out.error == ""
    assert out.last_loss < out.first_loss - 0.5, (
        f"not a healthy run: loss {out.first_loss:.2f} → {out.last_loss:.2f}"
    )
    warnings = [e for e in out.events if is_warning(e)]
    print(f"{out.name}: {len(out.events)} events, {len(warnings)} warnings\n{show(out.events)}")
    assert not warnings, f"false alarms on the healthy run {out.name}:\n{show(warnings)}"


@pytest.mark.parametrize("cfg", CI[:2], ids=[c.name for c in CI[:2]])
@pytest.mark.parametrize("which", [0, 1], ids=["x20-early-x5-late", "x5-early-x20-late"])
def test_planted_spikes_are_found(cfg: object, which: int) -> None:
    spikes = planted_spikes(QUICK_STEPS)[which]
    out = run_config(cfg, steps=QUICK_STEPS, spikes=spikes)  # type: ignore[arg-type]
    assert out.error == ""
    missed = [s for s in spikes if spike_finder(out.events, s.step) is None]
    near = [e for e in out.events if any(s.step - 2 <= int(e["step"]) <= s.step + 5 for s in spikes)]
    print(f"{out.name} + {spikes}: events near the spikes:\n{show(near)}")
    assert not missed, (
        f"planted loss spikes not found within {SPIKE_TOLERANCE} steps by a warning: "
        + ", ".join(f"×{s.factor:g} at step {s.step} (loss {out.losses[s.step]:.3g})" for s in missed)
        + f"\nevents near them:\n{show(near)}"
    )

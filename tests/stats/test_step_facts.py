"""`StepFacts` (stabkit/stats/step_facts.py): what the step knows, one object per Monitor shared by the
probes and the detectors' device parts — the after-update note is for one step and is taken once, and
two monitors never see each other's facts (no process-global mailbox)."""

from __future__ import annotations

import torch
from torch import nn

import stabkit
from stabkit.stats.step_facts import FiniteSeen, StepFacts


def test_the_after_update_note_is_for_its_step_and_taken_once() -> None:
    facts = StepFacts()
    t = torch.zeros(3)
    flag = torch.tensor(True)
    facts.leave_after_update(4, FiniteSeen(tensors={id(t)}, flags=[flag]))
    assert facts.take_after_update(5) is None  # another step: not this note (and it is gone)
    assert facts.take_after_update(4) is None
    facts.leave_after_update(4, FiniteSeen(tensors={id(t)}, flags=[flag]))
    note = facts.take_after_update(4)
    assert note is not None and note.tensors == frozenset({id(t)}) and bool(note.flag)
    assert facts.take_after_update(4) is None  # taken once
    facts.leave_after_update(6, FiniteSeen())  # nothing read: no note
    assert facts.take_after_update(6) is None


def test_scaled_only_with_an_enabled_grad_scaler() -> None:
    assert not StepFacts().scaled
    assert not StepFacts(scaler=torch.amp.GradScaler("cpu", enabled=False)).scaled
    assert StepFacts(scaler=torch.amp.GradScaler("cpu")).scaled


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Embedding(32, 16), nn.TransformerEncoder(layer, 1, enable_nested_tensor=False))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_each_monitor_owns_its_facts_and_shares_them_with_its_plugins(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = stabkit.MonitorConfig(every=1, console=False, detect=stabkit.DetectConfig(sync=True))
    (m1, o1), (m2, o2) = make(0), make(1)
    with (
        stabkit.attach(m1, o1, logdir=tmp_path / "a", config=config) as a,
        stabkit.attach(m2, o2, logdir=tmp_path / "b", config=config) as b,
    ):
        assert a.facts is not b.facts
        assert a.context.facts is a.facts and b.context.facts is b.facts  # the probes'
        calls: list[tuple[str, int, int]] = []
        for name, mon in (("a", a), ("b", b)):
            leave, take = mon.facts.leave_after_update, mon.facts.take_after_update

            def spy_leave(step, seen, _l=leave, _n=name):  # type: ignore[no-untyped-def]
                calls.append((_n + " leave", step, len(seen.tensors)))
                _l(step, seen)

            def spy_take(step, _t=take, _n=name):  # type: ignore[no-untyped-def]
                note = _t(step)
                calls.append((_n + " take", step, len(note.tensors) if note else 0))
                return note

            mon.facts.leave_after_update, mon.facts.take_after_update = spy_leave, spy_take  # type: ignore[method-assign]
        for step in range(3):
            for model, opt, mon in ((m1, o1, a), (m2, o2, b)):
                x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step))
                loss = model(x).pow(2).mean()
                loss.backward()
                opt.step()
                assert mon.facts._note is None  # the non-finite check took its step's note at once
                mon.step(loss)
                opt.zero_grad()
        assert not a.facts.update_skipped and not b.facts.update_skipped  # no GradScaler: never skipped
        # each step: the update-norm pass left a note (every parameter and both Adam moments read) and
        # its own monitor's check took it, in the same step — never the other monitor's
        n = 3 * len(list(m1.parameters()))
        for name in ("a", "b"):
            mine = [c for c in calls if c[0].startswith(name)]
            assert [c[0] for c in mine] == [f"{name} leave", f"{name} take"] * 3, calls
            assert all(c[2] == n for c in mine), mine
            assert [c[1] for c in mine] == [0, 0, 1, 1, 2, 2]
        assert [e.kind for e in a.events] == [] and [e.kind for e in b.events] == []

"""A full disk or a read-only logdir never stops training: the failing sink warns once and is switched
off, the others go on, `Monitor.history` and `Monitor.events` keep everything; action `dump` on a
failing disk keeps the event and the step's action. Faults are injected by monkeypatching (tests run
as root, where chmod does not stop writes)."""

from __future__ import annotations

import builtins
import errno
import io
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
import stabkit.actions.dump as actions_mod
from stabkit.events import Event
from stabkit.sinks import LOG_NAME, JsonlSink, SinkSet, read_jsonl


def disk_error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class FullFile:
    """A text file object on a full disk: every write raises ENOSPC."""

    closed = False

    def write(self, text: str) -> int:
        raise disk_error(errno.ENOSPC)

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return 2

    def close(self) -> None:
        self.closed = True


def refuse_writes_under(monkeypatch: pytest.MonkeyPatch, root: Path, code: int) -> None:
    """Every open-for-writing and mkdir under `root` raises OSError(code), in every thread (TensorBoard
    writes from its own thread through io.open)."""
    real_open, real_mkdir, real_makedirs = builtins.open, os.mkdir, os.makedirs

    def inside(path: Any) -> bool:
        text = os.fsdecode(path) if isinstance(path, bytes | str | os.PathLike) else ""
        return text.startswith(str(root))

    def fake_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if inside(file) and any(c in mode for c in "wax+"):
            raise OSError(code, os.strerror(code), os.fsdecode(file))
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if inside(path):
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        real_mkdir(path, *args, **kwargs)

    def fake_makedirs(path: Any, *args: Any, **kwargs: Any) -> None:
        if inside(path):
            raise OSError(code, os.strerror(code), os.fsdecode(path))
        real_makedirs(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "makedirs", fake_makedirs)


class Run:
    """Tiny GPT + SGD + monitor; `step(poison=True)` makes blocks.0.mlp.fc output NaN."""

    def __init__(self, logdir: Path, **detect: Any) -> None:
        torch.manual_seed(0)
        self.model = reference_gpt()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.poison = False
        self.model.blocks[0].mlp.fc.register_forward_hook(
            lambda m, a, out: out * math.nan if self.poison else None
        )
        cfg = stabkit.MonitorConfig(
            log_every=2, every=1, console=False, detect=stabkit.DetectConfig(**detect)
        )
        self.mon = stabkit.attach(self.model, self.opt, logdir=logdir, config=cfg)

    def step(self, poison: bool = False) -> int:
        s = self.mon.global_step
        self.poison = poison
        x, y = batch(s)
        loss = lm_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.mon.step(loss)
        self.opt.zero_grad(set_to_none=True)
        self.poison = False
        return s


def stabkit_warnings(record: list[warnings.WarningMessage], needle: str) -> list[str]:
    return [str(w.message) for w in record if needle in str(w.message)]


def test_full_disk_mid_run_switches_the_sinks_off_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = Run(tmp_path, actions={"nonfinite": "skip"})
    for _ in range(2):
        run.step()  # steps 0, 1 reach the disk
    jsonl = next(s for s in run.mon.sinks.files if isinstance(s, JsonlSink))
    jsonl._fh.close()
    monkeypatch.setattr(jsonl, "_fh", FullFile())
    refuse_writes_under(monkeypatch, tmp_path, errno.ENOSPC)  # TensorBoard's writer thread too
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(6):
            run.step()
        s = run.step(poison=True)  # an event on a full disk
        run.step()
        run.mon.detach()
    monkeypatch.undo()
    failed = stabkit_warnings(record, "cannot write")
    assert len(failed) == 2, failed  # once per sink, not once per write
    assert all("ENOSPC" in m and "training goes on" in m for m in failed)
    assert set(run.mon.sinks.failures.values()) == {"ENOSPC: No space left on device"}
    assert [step for step, _ in run.mon.history] == list(range(10))  # kept in memory
    assert [(e.step, e.kind) for e in run.mon.events] == [(s, "nonfinite")]
    on_disk = [r["step"] for r in read_jsonl(tmp_path / LOG_NAME) if r["type"] == "metrics"]
    assert on_disk == [0, 1]  # what was written before the disk filled stays readable


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_read_only_logdir_at_attach_trains_and_monitors_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    logdir = tmp_path / "ro"
    refuse_writes_under(monkeypatch, logdir, code)
    with pytest.warns(RuntimeWarning, match=errno.errorcode[code]):
        run = Run(logdir)
    for _ in range(4):
        run.step()
    run.mon.detach()
    assert [step for step, _ in run.mon.history] == [0, 1, 2, 3]
    assert run.mon.sinks.failures and not run.mon.sinks.files


def test_read_only_logdir_mid_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The logdir becomes read-only (a remount after disk errors): the writes fail with EROFS."""
    run = Run(tmp_path)
    run.step()
    jsonl = next(s for s in run.mon.sinks.files if isinstance(s, JsonlSink))

    def refuse(*_: Any) -> None:
        raise disk_error(errno.EROFS)

    monkeypatch.setattr(jsonl, "_write", refuse)
    monkeypatch.setattr(jsonl, "flush", refuse)
    with pytest.warns(RuntimeWarning, match="EROFS"):
        for _ in range(4):
            run.step()
    run.mon.detach()
    assert [step for step, _ in run.mon.history] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "fault",
    [
        lambda *a, **k: (_ for _ in ()).throw(disk_error(errno.ENOSPC)),
        # torch.save reports a full disk as a RuntimeError from its zip writer
        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("file write failed")),
    ],
    ids=["oserror", "torch-save-runtimeerror"],
)
def test_dump_on_a_failing_disk_keeps_the_event_and_skips_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: Callable[..., None]
) -> None:
    run = Run(tmp_path, actions={"nonfinite": ["dump", "skip"]})
    run.step()
    monkeypatch.setattr(actions_mod.torch, "save", fault)
    before = [p.detach().clone() for p in run.model.parameters()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        s1 = run.step(poison=True)  # must not raise out of optimizer.step()
        after_first = [p.detach().clone() for p in run.model.parameters()]
        s2 = run.step(poison=True)
        run.step()  # training goes on
    events = [e for e in run.mon.events if e.kind == "nonfinite"]
    assert [e.step for e in events] == [s1, s2]
    assert all(e.details["dump"].startswith("failed: ") for e in events)
    assert all(e.details.get("skipped_update") for e in events)  # the other action still ran
    assert all(torch.equal(a, b) for a, b in zip(before, after_first, strict=True))
    assert len(stabkit_warnings(record, "could not save")) == 1
    assert not list((tmp_path / "stabkit-dumps").glob("*.pt"))  # no half-written dump left
    rows = read_jsonl(tmp_path / LOG_NAME)
    assert [r["step"] for r in rows if r["type"] == "event"] == [s1, s2]
    run.mon.detach()


class Recording:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.events: list[Event] = []

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        self.steps.append(step)

    def write_event(self, event: Event) -> None:
        self.events.append(event)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class Broken(Recording):
    label = "broken sink"

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        raise disk_error(errno.ENOSPC)

    def write_event(self, event: Event) -> None:
        raise disk_error(errno.ENOSPC)


def test_one_failing_sink_leaves_the_others_writing() -> None:
    sinks = SinkSet(None, tensorboard=False, jsonl=False, console=False)
    good, bad = Recording(), Broken()
    sinks.files += [bad, good]
    event = Event(3, "spike", "loss", 9.0, 6.0, "m")
    with pytest.warns(RuntimeWarning, match="broken sink") as record:
        sinks.write_rows([(1, {"loss": 1.0}), (2, {"loss": 1.0})])
        sinks.write_event(event)
        sinks.write_rows([(3, {"loss": 1.0})])
        sinks.close()
    assert len([w for w in record if "broken sink" in str(w.message)]) == 1
    assert good.steps == [1, 2, 3] and good.events == [event]
    assert sinks.failures == {"broken sink": "ENOSPC: No space left on device"}


def test_strict_still_raises_bugs_but_not_disk_errors() -> None:
    class Buggy(Recording):
        def write_metrics(self, step: int, values: dict[str, float]) -> None:
            raise TypeError("a bug")

    sinks = SinkSet(None, tensorboard=False, jsonl=False, console=False, strict=True)
    sinks.files += [Buggy()]
    with pytest.raises(TypeError):
        sinks.write_rows([(1, {"loss": 1.0})])
    sinks = SinkSet(None, tensorboard=False, jsonl=False, console=False, strict=True)
    sinks.files += [Broken()]
    with pytest.warns(RuntimeWarning, match="ENOSPC"):
        sinks.write_rows([(1, {"loss": 1.0})])

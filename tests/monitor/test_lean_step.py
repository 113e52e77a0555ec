"""The fixed cost of an unsampled step, guarded by structure, not by the clock: the Python calls
stabkit's own code makes during one unsampled training step of a fixed model are counted
(``sys.setprofile``) against an upper bound, and no walk of the model (``Module.parameters``,
``named_modules`` ...) may start from stabkit's code on such a step. A change that rebuilds
something structural every step (parameter lists, module walks, names, closures) fails here.

The bounds are the counts measured when they were set plus a margin for small changes; a change
that needs more calls per step should say why where it raises them."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit

STABKIT = os.path.dirname(stabkit.__file__) + os.sep
HARNESS = os.path.join(STABKIT, "harness") + os.sep
"""The reference GPT lives in the package but is the user's model here: its calls are not stabkit's."""
MODULE_PY = os.path.join(os.path.dirname(nn.__file__), "modules", "module.py")
WALKS = {
    "parameters",
    "named_parameters",
    "modules",
    "named_modules",
    "children",
    "named_children",
    "buffers",
}
"""`nn.Module` methods that walk the module tree."""

QUIET = {"console": False, "audit": False}

DEFAULT_BOUND = 130
"""Calls into stabkit's code on an unsampled step under the default config (detectors on): 102
measured on this model with no stabkit hook left on the root between sampled steps (an empty batch
found by the sampled steps' training-forward markers, not refused by a root pre-hook on every
forward; 112 before), the warn-only output check made on sampled steps only
(its root hook parked between; 116 with it every step), the gradient probe's per-step checks made with C-level
``map`` over its parameters and reading only the frozen ones' flags (134 before), with the sampled-only forward hooks parked between
sampled steps (`stabkit.hook_parking`; 158 with them in place, each returning after a flag check; 195
while the non-finite kind was decided every step on a CPU by default and the root pre-hook kept each
forward's inputs for a warn-only run; with the per-step parameter walk removed before that put back,
243 and two walks)."""
NO_DETECT_BOUND = 80
"""The same with ``detect=None`` (probes only): 62 measured (65 with the root's hooks every step, 81 before the gradient probe's C-level
checks, 104 with the hooks in place, 148 with
the walk)."""
ACTING_BOUND = 340
"""With an action on non-finite steps (``skip``: the parameters and optimizer state are checked after
every update, the second moments before it): 296 measured (one more than before the output check got
its cadence test: it runs every step here; 313 before the gradient probe's C-level
checks, 337 with the hooks in place); with the
model's parameters listed by a walk at each check (before this was cached) the same count and one walk
per step."""


def _ours(code_file: str) -> bool:
    return code_file.startswith(STABKIT) and not code_file.startswith(HARNESS)


def _from_stabkit(frame: FrameType | None) -> bool:
    while frame is not None:
        if _ours(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


class CallCount:
    """Counts, while active, the Python calls whose code is stabkit's, and the module walks that
    stabkit's code started (`walks`: (method, caller) pairs)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.walks: list[tuple[str, str]] = []
        self._frames: dict[int, FrameType] = {}

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if _ours(code.co_filename):
            self.calls[f"{code.co_filename[len(STABKIT) :]}:{code.co_name}"] += 1
        elif code.co_name in WALKS and code.co_filename == MODULE_PY:
            caller = frame.f_back
            nested = caller is not None and caller.f_code.co_filename == MODULE_PY  # a walk's own recursion
            resumed = id(frame) in self._frames  # a generator (`parameters()`) resumed: the same walk
            self._frames[id(frame)] = frame  # kept alive to the end, so ids stay unique
            if not nested and not resumed and _from_stabkit(caller):
                where = f"{caller.f_code.co_filename}:{caller.f_lineno}" if caller else "?"
                self.walks.append((code.co_name, where))

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def run(self, fn: Callable[[], None]) -> None:
        sys.setprofile(self)
        try:
            fn()
        finally:
            sys.setprofile(None)


def _loop(config: stabkit.MonitorConfig) -> tuple[stabkit.Monitor, Callable[[], None]]:
    torch.manual_seed(0)
    model = reference_gpt(dropout=0.1, positions="rope")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(model, opt, config=config)
    step_no = [0]

    def step() -> None:
        x, y = batch(step_no[0])
        step_no[0] += 1
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        mon.step(loss)
        opt.zero_grad(set_to_none=True)

    return mon, step


@pytest.mark.parametrize(
    ("detect", "bound"),
    [("default", DEFAULT_BOUND), (None, NO_DETECT_BOUND), ("skip", ACTING_BOUND)],
    ids=["default", "no-detect", "nonfinite-skip"],
)
def test_an_unsampled_step_makes_few_calls_and_walks_no_module(detect: str | None, bound: int) -> None:
    torch.set_num_threads(1)
    extra: dict[str, Any] = {}
    if detect is None:
        extra["detect"] = None
    elif detect == "skip":
        extra["detect"] = stabkit.DetectConfig(actions={"nonfinite": "skip"})
    mon, step = _loop(stabkit.MonitorConfig(every=10, log_every=10, **QUIET, **extra))
    for _ in range(3):  # past the sampled step 0 and the first steps' one-off work
        step()
    assert mon.global_step % 10 not in (0, 9)  # the next step is unsampled and flushes nothing
    hooked = [n for n, m in mon.model.named_modules() if m._forward_hooks or m._forward_pre_hooks]
    # only an acting run keeps hooks there: the root's, which keep each forward's inputs for a replay
    assert hooked == ([""] if detect == "skip" else []), (
        f"modules with forward hooks on an unsampled step: {hooked}"
    )
    count = CallCount()
    count.run(step)
    mon.detach()
    top = ", ".join(f"{k} ×{v}" for k, v in count.calls.most_common(8))
    assert count.walks == [], f"stabkit walked the model on an unsampled step: {count.walks[:5]}"
    assert count.total <= bound, (
        f"{count.total} calls into stabkit on an unsampled step (bound {bound}): {top}"
    )
    assert count.total > 0  # the counter sees stabkit's hooks at all


def test_the_counter_sees_a_walk_that_stabkit_starts() -> None:
    """The walk check is live: a module walk started from a stabkit frame is caught."""
    from stabkit.probes.base import select_modules

    model = reference_gpt()
    count = CallCount()
    count.run(lambda: select_modules(model, "blocks.*", []))
    assert any(name == "named_modules" for name, _ in count.walks)

"""Code torch.compile compiled in this process, as stabkit sees it: how many frames Dynamo has compiled
(`dynamo_frames`), and dropping what was compiled without (or with stale) stabkit hooks
(`forget_compiled_code`).

Dynamo does not guard on module hooks by default (``skip_nnmodule_hook_guards``): code compiled before
attach runs without stabkit's hooks, code compiled while attached keeps calling hooks detach removed,
and code compiled while hooks were parked (`stabkit.hook_parking`) would never see them come back.

When it runs: `forget_compiled_code` at attach, at detach and when hook parking stops;
`dynamo_frames` there and once a step while hooks are parked (a dict read).
"""

from __future__ import annotations

import sys
import warnings


def dynamo_frames() -> int:
    """Frames torch.compile has compiled in this process so far (0 when Dynamo was never imported)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return 0
    frames = dynamo.utils.counters.get("frames")
    return 0 if frames is None else int(frames.get("total", 0))


_FRAMES_AT_RESET = [0]
"""Dynamo's frame count (`dynamo_frames`) when `forget_compiled_code` last reset compiled code:
process-wide, as Dynamo's cache is. Dynamo's counters survive ``torch._dynamo.reset()``."""


def forget_compiled_code(warn: bool = True) -> None:
    """At attach (and detach): when torch.compile has compiled code in this process since stabkit last
    reset it, drop it, so the next call recompiles with stabkit's hooks (Dynamo does not guard on
    module hooks by default, so code compiled before attach would run without them, and code
    compiled while attached would keep calling hooks detach removed). Warns at attach: compiled
    functions recompile once. Nothing compiled since the last reset (an attach after a detach, with
    no compile between): nothing to drop, no warning."""
    frames = dynamo_frames()
    if frames in (
        0,
        _FRAMES_AT_RESET[0],
    ):  # 0: nothing compiled (or Dynamo never imported, or its counters cleared)
        return
    sys.modules["torch._dynamo"].reset()
    _FRAMES_AT_RESET[0] = frames
    if warn:
        warnings.warn(
            "stabkit: torch.compile had compiled code in this process before attach; it was reset so that "
            "stabkit's hooks run (compiled models recompile once at their next call)",
            RuntimeWarning,
            stacklevel=4,
        )

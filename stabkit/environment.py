"""Environment variables read by `stabkit.attach`, for scripts one cannot edit.

- ``STABKIT_DISABLE``: ``1`` / ``true`` / ``yes`` / ``on`` (any case) makes `attach` return a
  `stabkit.disabled.DisabledMonitor`: the same API, nothing hooked, nothing written. ``0`` / ``false``
  / ``no`` / ``off`` / empty / unset: monitoring as usual. Anything else is a ValueError at attach.
- ``STABKIT_LOGDIR``: the logdir when the code passes none (``logdir=None``). A logdir the code
  passes wins, as ``WANDB_DIR`` or ``MLFLOW_TRACKING_URI`` fill only what the code left open.

Read at each `attach` (not at import), so a notebook can set them between runs. A leaf: stdlib only.
"""

from __future__ import annotations

import os
from pathlib import Path

DISABLE = "STABKIT_DISABLE"
LOGDIR = "STABKIT_LOGDIR"

_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def disabled() -> bool:
    """Whether ``STABKIT_DISABLE`` switches monitoring off (see the module notes)."""
    value = os.environ.get(DISABLE, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(
        f"{DISABLE}={os.environ[DISABLE]!r}: use 1 (monitoring off) or 0 (on); "
        f"also accepted: {', '.join(_ON[1:])} / {', '.join(_OFF[2:])}"
    )


def env_logdir(logdir: str | Path | None) -> str | Path | None:
    """`logdir` when the code gave one, else ``STABKIT_LOGDIR`` (None when unset or empty)."""
    if logdir is not None:
        return logdir
    value = os.environ.get(LOGDIR, "").strip()
    return value or None

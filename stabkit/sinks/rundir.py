"""Which folder a run writes to, so that two runs never mix silently in one logdir.

`choose_logdir` runs once, when the sinks are built at `attach` (on the writing rank). A logdir
*holds a run* when stabkit's JSONL log or a TensorBoard event file sits directly in it. Modes
(`MonitorConfig.logdir_mode`):

- ``"new"`` (default): an empty logdir is used as is; one that holds a run gets the next free
  subfolder ``run-2``, ``run-3``, … (TensorBoard shows each as its own run; `stabkit report LOGDIR`
  lists them side by side).
- ``"append"``: write into the logdir as it is, after what is there (e.g. resuming from a
  checkpoint: steps continue from `Monitor.load_state_dict`).
- ``"overwrite"``: delete the previous run's stabkit files first (`clear_logs`; other files stay).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..config import LOG_MODES

"""The values `MonitorConfig.logdir_mode` takes."""
RUN_PREFIX = "run-"
"""Subfolders ``run-<n>`` (n >= 2) hold the later runs of a logdir in mode "new"."""
_RUN_DIR = re.compile(r"^run-(\d+)$")


def is_log_file(path: Path) -> bool:
    """stabkit's JSONL log or a TensorBoard event file."""
    return path.name == "stabkit.jsonl" or path.name.startswith("events.out.tfevents.")


def holds_run(folder: Path) -> bool:
    """Whether `folder` directly holds a run's logs (JSONL log or TensorBoard event file)."""
    return folder.is_dir() and any(is_log_file(p) for p in folder.iterdir() if p.is_file())


def run_number(folder: Path) -> int | None:
    """n for a folder named ``run-<n>``, else None."""
    match = _RUN_DIR.match(folder.name)
    return int(match.group(1)) if match else None


def run_folders(root: str | Path) -> list[Path]:
    """The runs under `root` in order: `root` itself when it holds one, then ``run-2``, ``run-3``, …
    (those that hold logs). Runs when a report reads a logdir."""
    root = Path(root)
    if not root.is_dir():
        return []
    subs = sorted(
        (p for p in root.iterdir() if p.is_dir() and run_number(p) is not None and holds_run(p)),
        key=lambda p: run_number(p) or 0,
    )
    return ([root] if holds_run(root) else []) + subs


def clear_logs(folder: str | Path) -> bool:
    """Delete stabkit's JSONL log, TensorBoard event files and dumps in `folder` (other files stay).
    Returns whether anything was deleted."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    removed = False
    for path in folder.iterdir():
        if path.is_file() and is_log_file(path):
            path.unlink()
            removed = True
        elif path.name == "stabkit-dumps" and path.is_dir():
            shutil.rmtree(path)
            removed = True
    return removed


def choose_logdir(logdir: str | Path, mode: str = "new") -> tuple[Path, str | None]:
    """The folder this run writes to, and a note for the console when it is not simply `logdir`
    (None otherwise). Creates the folder; raises OSError when it cannot."""
    if mode not in LOG_MODES:
        raise ValueError(f"logdir mode must be one of {', '.join(LOG_MODES)}, got {mode!r}")
    root = Path(logdir)
    if not holds_run(root):
        root.mkdir(parents=True, exist_ok=True)
        return root, None
    if mode == "append":
        return root, f"appending to the run already in {root} (logdir_mode='append')"
    if mode == "overwrite":
        clear_logs(root)
        return root, f"replaced the previous run's logs in {root} (logdir_mode='overwrite')"
    taken = [n for p in root.iterdir() if p.is_dir() and (n := run_number(p)) is not None]
    n = max([1, *taken]) + 1
    while True:
        folder = root / f"{RUN_PREFIX}{n}"
        try:
            folder.mkdir()  # exclusive: two runs starting at once get different folders
        except FileExistsError:
            n += 1
            continue
        return folder, (
            f"{root} already holds a run's logs: this run writes to {folder} "
            "(MonitorConfig.logdir_mode: 'new' | 'append' | 'overwrite')"
        )

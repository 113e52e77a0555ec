"""`MonitorConfig.from_toml`: a MonitorConfig from a TOML file's ``[monitor]`` and ``[detect]`` tables.

The same tables as a stress-test recipe (``recipes/*.toml``): ``[monitor]`` holds any MonitorConfig
field but ``detect`` (``every``, ``attn_every``, ``log_every``, ``modules``, ``families``, ...), and
``[detect]`` the `DetectConfig` (``sync``, ``detectors``, ``actions``, ``options``, ...). Every key
and value is checked by `stabkit.tables.fill` (an unknown key or a bad value is a ValueError naming
the file and ``monitor.<key>``). Only the top-level tables are read: a recipe's ``[sizes.<name>]``
and ``[variants.*]`` are the recipe runner's. Runs once, when called (before `attach`).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, TypeVar

from .detect_config import DetectConfig
from .tables import TableError, fill, keys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


ConfigT = TypeVar("ConfigT")


def read_monitor_config(cls: type[ConfigT], path: str | Path, overrides: dict[str, Any]) -> ConfigT:
    """The config (`cls`: `stabkit.MonitorConfig`, which calls this from `from_toml`; passed in so
    this module does not import it back) of `path`'s ``[monitor]`` and ``[detect]`` tables (library
    defaults for what they leave out; a file with neither gives the defaults), then `overrides`
    (field -> value)."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from None
    misplaced = sorted(set(doc) & set(keys(cls)) - {"monitor", "detect"})
    if misplaced:
        raise ValueError(
            f"{path}: {', '.join(misplaced)} must sit under a [monitor] table (top-level keys are not read)"
        )
    try:
        detect = fill(DetectConfig, doc.get("detect"), "detect")
        config: Any = fill(cls, doc.get("monitor"), "monitor", exclude=("detect",))  # a dataclass
    except TableError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return dataclasses.replace(config, **{"detect": detect, **overrides})

"""The stress-test harness: a reference GPT, its training data and loop, and the recipes that make
instabilities happen on purpose (`stabkit run`, `stabkit sweep`).

Kept apart from the monitoring library (``stabkit.monitor``, ``stabkit.detectors``, ...): the
library never needs the harness to watch a model, the harness uses the library like any user.

- `stabkit.harness.models`: the reference GPT, its config and size presets;
- `stabkit.harness.data`: byte-level text (embedded by default);
- `stabkit.harness.training`: the training loop (the caller passes the monitor in);
- `stabkit.harness.recipes`: recipe files (built-ins in the top-level ``recipes/`` folder, shipped as ``stabkit.harness.recipes.builtin``), runs, sweeps, verdicts;
- `stabkit.harness.launch`: `stabkit run --nproc N` (torchrun relaunch and the rank's side).
"""

from __future__ import annotations

from ..lazy import lazy

SUBPACKAGES = frozenset({"data", "launch", "models", "recipes", "training"})
"""``stabkit.harness.models`` (etc.) after a bare ``import stabkit``: loaded on first use."""

__getattr__, __dir__ = lazy(__name__, {}, SUBPACKAGES)

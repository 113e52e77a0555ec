"""The load ratios of each MoE layer, taken on the host from the per-expert token counts.

Runs at each log interval, after the one host copy and the cross-rank reduction (`Monitor.flush` calls
`MoEProbe.finish_rows`). The counts ``moe/<layer>/load[e]`` are sums over micro-batches and ranks, so
the ratios below are those of the whole step's batch — exact under DDP, FSDP2 and expert parallelism,
where every rank routes its own tokens (a ratio of each rank's counts, averaged, would not be):

- ``max_vio`` = (max − mean) / mean load (0: balanced; E/k − 1: every token on the same k experts);
- ``cv`` = standard deviation / mean load (population std over the E experts);
- ``busiest_share`` = the busiest expert's share of the step's expert choices (k per token);
- ``dead_experts`` = experts that got no token in any sampled step of the last `window` steps (written
  once `window` steps have passed since attach).

The per-expert counts stay in the rows: the TensorBoard sink draws them as one histogram per layer.
"""

from __future__ import annotations

import math
import re

from ..metric_names import MOE, metric

LOAD = re.compile(r"^(moe/.+)/load\[(\d+)\]$")


def load_name(layer: str, expert: int) -> str:
    """The metric name of one expert's token count."""
    return metric(MOE, layer, f"load[{expert}]")


def load_ratios(load: list[float]) -> dict[str, float]:
    """max_vio, cv and busiest_share of one layer's per-expert counts (empty when no token was routed)."""
    total = sum(load)
    if not load or total <= 0:
        return {}
    mean = total / len(load)
    std = math.sqrt(sum((x - mean) ** 2 for x in load) / len(load))
    return {"max_vio": (max(load) - mean) / mean, "cv": std / mean, "busiest_share": max(load) / total}


class LoadFinisher:
    """Adds the ratios to the rows and keeps, per layer, the last step each expert had a token."""

    def __init__(self, window: int, start: int = 0) -> None:
        self.window = window
        self.start = start
        """The step the window counts from (the step at attach)."""
        self.last_seen: dict[str, list[int]] = {}

    def finish(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Add ``max_vio``, ``cv``, ``busiest_share`` and ``dead_experts`` per layer to each row, in place."""
        for step, row in rows:
            layers: dict[str, dict[int, float]] = {}
            for name, value in row.items():
                m = LOAD.match(name)
                if m is not None:
                    layers.setdefault(m.group(1), {})[int(m.group(2))] = value
            for prefix, by_expert in layers.items():
                load = [by_expert.get(e, 0.0) for e in range(max(by_expert) + 1)]
                for stat, value in load_ratios(load).items():
                    row[f"{prefix}/{stat}"] = value
                seen = self.last_seen.setdefault(prefix, [self.start - 1] * len(load))
                for e, x in enumerate(load):
                    if x > 0:
                        seen[e] = step
                if step + 1 - self.start >= self.window:
                    row[f"{prefix}/dead_experts"] = float(sum(1 for s in seen if step - s >= self.window))

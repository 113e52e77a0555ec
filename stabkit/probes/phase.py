"""`StepPhase`: which statistics the step in progress takes, in a form compiled hooks can read.

Set by the Monitor whenever its step count changes (`ProbeContext.refresh`: at attach, at each
`Monitor.step`, at `load_state_dict`), never by a hook. Eager hooks simply ask it. Under
``torch.compile`` the hooks are traced into the model's graph, and what they read decides the set
of graphs — a hook that read the step number would be guarded on it and recompile every step. Two
ways keep the set fixed after warm-up; the phase picks one at attach, by the model's device:

- *gated* (a CPU): one graph. The traced hooks always call the statistics' opaque ops
  (`stabkit.stats.opaque`, `stabkit.attention.measure.op`), and each op asks the phase's gate, at
  run time, whether its cadence samples this step; on other steps it returns zeros at once and the
  Recorder drops what it recorded (`Recorder.gate`). Nothing is guarded on, so the model compiles
  once — within ~10 % of the bare model's compile time, where a second graph costs ~30 % more on a
  CPU (its kernels differ: a sampled graph must materialise the activations it measures). An
  unsampled step pays one call per op that returns at once.
- *guarded* (an accelerator): two graphs, *sampled* and *unsampled*, selected by Dynamo's guard on
  the phase's Python flags `sampled` / `attn_sampled` (a stable value per kind of step). The
  unsampled graph is the bare model's; both are compiled in the first sampling cycle. A decision
  taken inside an op would be frozen by CUDA graphs (``mode="reduce-overhead"`` replays what was
  captured), a decision on a device flag would need a host sync; guards need neither.

The alternative the issue names, one graph with a device-side mask multiplied into the statistics,
would compute every statistic on every step (full-monitoring cost on each step).

``round`` is the attention sampling round (``step // attention_every``) as a 0-d int64 device
tensor, updated in place: the compiled attention probe picks its rows and queries from it by index
(`stabkit.attention.measure.sample`), so the rotating sample needs no recompile and survives CUDA graphs.
"""

from __future__ import annotations

import math

import torch

from ..stats.opaque import close_gate, open_gate

GATED: bool | None = None
"""Which way new phases go: None = by the model's device (gated on a CPU); True/False forces it
(tests run the accelerators' guarded graphs on a CPU)."""


class StepPhase:
    """The sampling decision of the step in progress (see the module docstring)."""

    def __init__(
        self,
        every: int,
        attn_every: int,
        device: torch.device,
        gated: bool | None = None,
        deep_every: int | None = None,
    ) -> None:
        self.every = every
        self.attn_every = attn_every
        self.deep_every = every if deep_every is None else deep_every
        self.step = 0
        self.sampled = True
        """Per-layer statistics on this step (``step % MonitorConfig.every == 0``)."""
        self.attn_sampled = True
        """Attention statistics on this step (``step % MonitorConfig.attention_every == 0``)."""
        self.deep_sampled = True
        """Whole-model statistics on this step (``step % MonitorConfig.deep_cadence == 0``)."""
        if gated is None:
            gated = device.type == "cpu" if GATED is None else GATED
        self.gated = gated
        """Compiled: one graph whose opaque ops ask `gate` at run time (else a graph per phase)."""
        self.gate = open_gate(self.on) if self.gated else -1
        """Key of this phase in the ops' gate registry (-1: not gated, the ops always measure)."""
        self.round = torch.zeros((), dtype=torch.int64, device=device)
        """0-d int64 device tensor: ``step // attention_every`` (updated in place by `set`)."""
        self._round_value = 0

    @property
    def any_every(self) -> int:
        """The cadence of the steps on which any statistic is taken (the gcd of the three: a step a
        multiple of it may be sampled by one of them, no other step is). Hooks every probe relies on
        (`stabkit.probes.forwards`) act on these steps."""
        return math.gcd(self.every, self.attn_every, self.deep_every)

    def set(self, step: int) -> None:
        """The step in progress is now `step` (eager, outside any hook)."""
        self.step = step
        self.sampled = step % self.every == 0
        self.attn_sampled = step % self.attn_every == 0
        self.deep_sampled = step % self.deep_every == 0
        value = step // self.attn_every
        if value != self._round_value:
            self._round_value = value
            self.round.fill_(value)  # no sync: an in-place fill on the device

    def on(self, every: int) -> bool:
        """Whether a probe with cadence `every` samples this step (a constant for the three cadences
        of the config; any other cadence is computed from the step — eager callers and ops only)."""
        if every == self.every:
            return self.sampled
        if every == self.attn_every:
            return self.attn_sampled
        if every == self.deep_every:
            return self.deep_sampled
        return self.step % every == 0

    def close(self) -> None:
        """Take the phase out of the gate registry (at detach; safe twice)."""
        if self.gate >= 0:
            close_gate(self.gate)
            self.gate = -1

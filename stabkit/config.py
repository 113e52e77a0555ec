"""`MonitorConfig`: what `stabkit.attach` measures, how often, and where it writes.

Read once at `attach`; the monitor never changes it afterwards. A leaf: it imports only the other
leaves (`stabkit.detect_config`, `stabkit.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import nn

from .detect_config import DetectConfig
from .plugins import PROBE_FAMILIES

ModuleSelection = str | Sequence[str] | Callable[[str, nn.Module], bool] | None

FAMILIES = ("act", "attn", "logits", "grad", "param", "update", "loss")
"""Statistic families: activations, attention logits, output logits, gradients, parameter norms,
update/parameter ratios, loss."""

LOG_MODES = ("new", "append", "overwrite")
"""What attach does with a logdir that already holds a run: a new ``run-<n>`` folder, add to it, or clear it."""

DEFAULT_FAMILIES = frozenset({"act", "attn", "logits", "grad", "param", "update", "loss"})


@dataclass
class MonitorConfig:
    """Settings of one Monitor. Defaults aim at ≤ 3 % added step time on a CPU."""

    every: int = 10
    """Per-layer statistics (activations, attention, logits, per-block grads, updates) on every N-th step."""
    log_every: int = 50
    """Copy statistics to the host and write the sinks every N steps (one host copy per interval)."""
    modules: ModuleSelection = None
    """Activation statistics for which modules: None = the roles discovery found (blocks, attention,
    MLP); a glob like ``"*"`` or ``"blocks.*.mlp"``; a list of globs/paths; or ``f(name, module) -> bool``."""
    families: frozenset[str] = field(default_factory=lambda: DEFAULT_FAMILIES)
    """Which statistic families are on (subset of FAMILIES)."""
    attn_every: int | None = None
    """Attention-logit statistics on every N-th step (None = same as `every`)."""
    attn_sample_rows: int | None = 4
    """Batch rows the attention probe measures (None = all rows, exact). The rows × queries budget is
    spent twice: a uniform sample (entropy) and, for the max, the queries most likely to hold it."""
    attn_sample_queries: int | None = 64
    """Query positions the attention probe measures per row (None = all, exact)."""
    attn_per_head: bool = False
    """Also log attention statistics per head."""
    attn_chunk_bytes: int = 1 << 20
    """Memory (bytes) the attention probe's temporaries may take at once (default 1 MiB): it measures
    in blocks of batch rows × heads × queries × keys that fit, so its memory does not grow with the
    sequence length, sampled or exact. Larger: fewer, larger kernels (faster on a GPU); >= 4096."""
    tensorboard: bool = True
    """Write TensorBoard event files (needs a logdir)."""
    jsonl: bool = True
    """Write a JSONL log of metrics and events (needs a logdir)."""
    console: bool = True
    """Print a one-line summary per log interval and every event to stderr."""
    logdir_mode: str = "new"
    """When the logdir already holds a run: "new" writes into the next free ``<logdir>/run-<n>``
    (said on stderr; see `Monitor.logdir`), "append" adds to it (resuming), "overwrite" deletes its
    stabkit logs first."""
    detect: DetectConfig | None = field(default_factory=DetectConfig)
    """Detectors and actions (NaN/Inf, spikes, drift, advice; see DetectConfig); None = off."""
    history: int | None = 1000
    """Logged steps kept in `Monitor.history` (oldest dropped; None = all, for short runs).
    The TensorBoard files and the JSONL log always hold every step."""
    audit: bool = True
    """Run `stabkit.audit` once at attach and write its report (TensorBoard text, JSONL)."""
    strict: bool = False
    """Raise instead of warning when a probe fails (default: warn once, disable that probe, train on)."""

    def __post_init__(self) -> None:
        for name in ("every", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MonitorConfig.{name} must be an integer >= 1, got {value!r}")
        if self.attn_every is not None and (
            not isinstance(self.attn_every, int) or isinstance(self.attn_every, bool) or self.attn_every < 1
        ):
            raise ValueError(
                f"MonitorConfig.attn_every must be None or an integer >= 1, got {self.attn_every!r}"
            )
        for name in ("attn_sample_rows", "attn_sample_queries"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(
                    f"MonitorConfig.{name} must be None (exact) or an integer >= 1, got {value!r}"
                )
        chunk = self.attn_chunk_bytes
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 4096:
            raise ValueError(
                f"MonitorConfig.attn_chunk_bytes must be an integer >= 4096 (bytes), got {chunk!r}"
            )
        if self.history is not None and (not isinstance(self.history, int) or self.history < 0):
            raise ValueError(
                f"MonitorConfig.history must be None (keep all) or an integer >= 0, got {self.history!r}"
            )
        if self.logdir_mode not in LOG_MODES:
            raise ValueError(
                f"MonitorConfig.logdir_mode must be one of {', '.join(LOG_MODES)}, got {self.logdir_mode!r}"
            )
        if self.detect is not None and not isinstance(self.detect, DetectConfig):
            raise ValueError("MonitorConfig.detect must be a stabkit.DetectConfig or None")
        self.families = frozenset(self.families)
        known = [*FAMILIES, *sorted(PROBE_FAMILIES - set(FAMILIES))]
        unknown = sorted(self.families - set(known))
        if unknown:
            raise ValueError(f"MonitorConfig.families has unknown name(s) {unknown}; allowed: {known}")
        sel = self.modules
        if not (sel is None or isinstance(sel, str) or callable(sel)) and (
            not isinstance(sel, Sequence) or not all(isinstance(s, str) for s in sel)
        ):
            raise ValueError(
                "MonitorConfig.modules must be None, a glob string, a list of globs, or a callable "
                f"(name, module) -> bool; got {type(sel).__name__}"
            )

    @classmethod
    def full(cls, **overrides: object) -> MonitorConfig:
        """Full detail: every module and attention logits on every step (attention on the default
        sample of rows and queries; pass attn_sample_rows=None, attn_sample_queries=None for exact)."""
        base: dict[str, object] = dict(every=1, modules="*", attn_every=1)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    @property
    def attention_every(self) -> int:
        """Cadence of the attention probe."""
        return self.attn_every or self.every

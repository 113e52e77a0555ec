"""`MonitorConfig`: what `stabkit.attach` measures, how often, and where it writes.

Read once at `attach`; the monitor never changes it afterwards. A leaf: it imports only the other
leaves (`stabkit.detect_config`, `stabkit.plugins`, `stabkit.tables`). `WandbOptions` and
`MlflowOptions` configure the experiment-tracker sinks (`stabkit.sinks.wandb_sink`,
`stabkit.sinks.mlflow_sink`); they sit here because `MonitorConfig` holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch import nn

from .detect_config import DetectConfig
from .plugins import PROBE_FAMILIES
from .tables import fill

ModuleSelection = str | Sequence[str] | Callable[[str, nn.Module], bool] | None

FAMILIES = ("act", "attn", "logits", "grad", "param", "update", "loss", "moe")
"""Statistic families: activations, attention logits, output logits, gradients, parameter norms,
update/parameter ratios, loss, mixture-of-experts routing (only where discovery found a router)."""

LOG_MODES = ("new", "append", "overwrite")
"""What attach does with a logdir that already holds a run: a new ``run-<n>`` folder, add to it, or clear it."""

DEEP_FACTOR = 5
"""`MonitorConfig.deep_every`'s default, in sampled steps: the whole-model statistics on every 5th
sampled step (every 50th step by default)."""
DEFAULT_FAMILIES = frozenset({"act", "attn", "logits", "grad", "param", "update", "loss", "moe"})


WANDB_MODES = (None, "online", "offline", "disabled", "shared")
"""The values `WandbOptions.mode` takes (None: ``WANDB_MODE``, else online)."""
MAX_INIT_TIMEOUT = 600.0
"""Longest `WandbOptions.init_timeout` taken (seconds)."""


@dataclass
class WandbOptions:
    """Where the Weights & Biases sink writes (`MonitorConfig.wandb`; needs ``pip install 'stabkit[wandb]'``).
    Fields left at None are W&B's own (its ``WANDB_*`` environment variables, then its defaults)."""

    project: str | None = None
    """W&B project of a run stabkit starts (None: ``WANDB_PROJECT``, else W&B's default)."""
    entity: str | None = None
    """W&B team or user (None: ``WANDB_ENTITY``, else your default entity)."""
    name: str | None = None
    """Name of a run stabkit starts (None: the logdir's folder name, else a name W&B picks)."""
    group: str | None = None
    """W&B group of a run stabkit starts (e.g. one per sweep or recipe)."""
    tags: tuple[str, ...] = ()
    """Tags of a run stabkit starts ("stabkit" is always added)."""
    mode: Literal["online", "offline", "disabled", "shared"] | None = None
    """W&B mode (None: ``WANDB_MODE``, else online). Offline runs upload later with ``wandb sync``."""
    dir: str | None = None
    """Folder for W&B's local files (None: the monitor's logdir when it has one, else ``WANDB_DIR``)."""
    join: bool = True
    """Log into the run this process already started (``wandb.run``) instead of starting one. stabkit
    finishes only a run it started itself."""
    prefix: str | None = None
    """Put before every metric name: None = "" in a run stabkit started, "stabkit/" in a joined run
    (stabkit's ``loss`` then does not mix with yours)."""
    base_url: str | None = None
    """W&B server of a run stabkit starts (None: ``WANDB_BASE_URL``, else your login's host)."""
    init_timeout: float = 30.0
    """Seconds W&B gets to start a run stabkit starts (W&B's own ``init_timeout``, 90 s by default);
    training never waits for it: the start runs on a background thread, rows wait for it."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"WandbOptions.mode must be one of {WANDB_MODES}, got {self.mode!r}")
        if not 0 < float(self.init_timeout) <= MAX_INIT_TIMEOUT:
            raise ValueError(
                f"WandbOptions.init_timeout must be in (0, {MAX_INIT_TIMEOUT:g}] seconds, got {self.init_timeout!r}"
            )
        self.init_timeout = float(self.init_timeout)
        self.tags = tuple(self.tags)


@dataclass
class MlflowOptions:
    """Where the MLflow sink writes (`MonitorConfig.mlflow`; needs ``pip install 'stabkit[mlflow]'``).
    Fields left at None are MLflow's own (its ``MLFLOW_*`` environment variables, then its defaults)."""

    tracking_uri: str | None = None
    """Tracking store: ``http(s)://host:port``, ``sqlite:///path/mlflow.db``, ``databricks``, a folder
    (None: ``MLFLOW_TRACKING_URI``, else MLflow's default — ``sqlite:///mlflow.db`` in MLflow 3)."""
    experiment: str | None = None
    """Experiment name of a run stabkit starts, created if missing (None: ``MLFLOW_EXPERIMENT_NAME`` or
    ``MLFLOW_EXPERIMENT_ID``, else MLflow's "Default")."""
    name: str | None = None
    """Name of a run stabkit starts (None: the logdir's folder name, else a name MLflow picks)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags of a run stabkit starts (``stabkit.logdir`` is added when there is a logdir)."""
    join: bool = True
    """Log into the active run (``mlflow.active_run()``, else ``MLFLOW_RUN_ID``) instead of starting
    one. stabkit ends only a run it started itself."""
    prefix: str | None = None
    """Put before every metric name: None = "" in a run stabkit started, "stabkit/" in a joined run."""


def tracker_options(value: Any, cls: type[Any], name: str) -> Any:
    """`MonitorConfig.wandb` / `.mlflow` as an options instance, or None when off: True = defaults, a
    dict = its fields (checked by `stabkit.tables.fill`: an unknown key or a wrong type is a ValueError
    naming ``MonitorConfig.<name>.<key>``)."""
    if value is None or value is False:
        return None
    if value is True:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return fill(cls, value, f"MonitorConfig.{name}")
    raise ValueError(
        f"MonitorConfig.{name} must be True/False, a dict of {cls.__name__} fields or a {cls.__name__}, "
        f"got {type(value).__name__}"
    )


@dataclass
class MonitorConfig:
    """Settings of one Monitor. Defaults aim at ≤ 3 % added step time on a CPU."""

    every: int = 10
    """Per-layer statistics (activations, attention, logits, per-block grads) on every N-th step
    (parameter and update norms, outliers and the optimizer-state checks: `deep_every`)."""
    log_every: int = 50
    """Copy statistics to the host and write the sinks every N steps (one host copy per interval)."""
    modules: ModuleSelection = None
    """Activation statistics for which modules: None = the roles discovery found (blocks, attention,
    MLP); a glob like ``"*"`` or ``"blocks.*.mlp"``; a list of globs/paths; or ``f(name, module) -> bool``."""
    families: frozenset[str] = field(default_factory=lambda: DEFAULT_FAMILIES)
    """Which statistic families are on (subset of FAMILIES)."""
    attn_every: int | None = None
    """Attention-logit statistics on every N-th step (None = same as `every`)."""
    deep_every: int | None = None
    """The statistics that read every parameter and optimizer moment, or a block output several
    times — parameter norms, update norms and ratios, massive activations and outlier-feature
    kurtosis, the optimizer state's NaN/Inf and negative-second-moment checks — on every N-th step,
    a multiple of `every` (None = `DEEP_FACTOR` × `every`; `every` itself when `every` is 1). On a
    small step they cost more than the rest of a sampled step (see `stabkit bench --size small-step`)."""
    attn_sample_rows: int | None = 4
    """Batch rows the attention probe measures (None = all rows, exact). The rows × queries budget is
    spent twice: a uniform sample (entropy) and, for the max, the queries most likely to hold it."""
    attn_sample_queries: int | None = 64
    """Query positions the attention probe measures per row (None = all, exact)."""
    attn_per_head: bool = False
    """Also log attention statistics per head."""
    attn_chunk_bytes: int = 4 << 20
    """Memory (bytes) the attention probe's temporaries may take at once (default 4 MiB): it measures
    in blocks of batch rows × heads × queries × keys that fit, so its memory does not grow with the
    sequence length, sampled or exact. Larger: fewer, larger kernels (each block costs a fixed ~60
    small ops; 1 MiB made the default sample two to four blocks per call on the small reference
    GPT, 4 MiB one or two); >= 4096."""
    tensorboard: bool = True
    """Write TensorBoard event files (needs a logdir)."""
    jsonl: bool = True
    """Write a JSONL log of metrics and events (needs a logdir)."""
    console: bool = True
    """Print a one-line summary per log interval and every event to stderr."""
    wandb: bool | dict[str, Any] | WandbOptions | None = None
    """Also write to Weights & Biases (`pip install 'stabkit[wandb]'`): True, or a `WandbOptions` (or
    a dict of its fields: project, name, mode, ...); None/False = off. Joins ``wandb.run`` if there is one."""
    mlflow: bool | dict[str, Any] | MlflowOptions | None = None
    """Also write to MLflow (`pip install 'stabkit[mlflow]'`): True, or an `MlflowOptions` (or a dict
    of its fields: tracking_uri, experiment, name, ...); None/False = off. Joins the active run if any."""
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
        deep = self.deep_every
        if deep is not None and (
            not isinstance(deep, int) or isinstance(deep, bool) or deep < 1 or deep % self.every
        ):
            raise ValueError(
                f"MonitorConfig.deep_every must be None or a multiple of every ({self.every}), got {deep!r}"
            )
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
        self.wandb = tracker_options(self.wandb, WandbOptions, "wandb")
        self.mlflow = tracker_options(self.mlflow, MlflowOptions, "mlflow")
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
        base: dict[str, object] = dict(every=1, modules="*", attn_every=1, deep_every=1)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    @classmethod
    def from_toml(cls, path: str | Path, **overrides: Any) -> MonitorConfig:
        """The settings of a TOML file's ``[monitor]`` table (any field but ``detect``) and ``[detect]``
        table (a `DetectConfig`) — the tables of a stress-test recipe — over the defaults, then
        `overrides` (e.g. ``console=False``). Unknown keys and bad values raise ValueError naming the
        file and the key (`stabkit.config_toml`)."""
        from .config_toml import read_monitor_config

        return read_monitor_config(cls, path, overrides)

    @property
    def deep_cadence(self) -> int:
        """Cadence of the whole-model statistics (`deep_every`, resolved)."""
        if self.deep_every is not None:
            return self.deep_every
        return self.every if self.every == 1 else DEEP_FACTOR * self.every

    @property
    def attention_every(self) -> int:
        """Cadence of the attention probe."""
        return self.attn_every or self.every

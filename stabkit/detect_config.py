"""`DetectConfig`: what the detectors watch, their thresholds, and what happens on an event.

Read once when a Monitor attaches; never changed afterwards. Defaults come from published
practice (see each field) and were checked against 2000-step runs of the tiny reference GPT.
A leaf: it imports only `stabkit.plugins` (for the names of the detectors and actions it accepts).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from .plugins import ACTIONS, DETECTORS

OptionsT = TypeVar("OptionsT")

LossFn = Callable[..., Any]
"""`loss_fn(output, *args, **kwargs) -> scalar loss`: recomputes a step's loss from the model output and inputs."""


def _default_actions() -> dict[str, Any]:
    return {}


def _default_min_ratio() -> dict[str, float]:
    return {"loss": 1.5, "grad/*": 5.0, "update/*": 2.0, "*": 1.0}


@dataclass
class DetectConfig:
    """Settings of the detectors and actions of one Monitor.

    Timing: with every action at ``warn`` (the default) nothing is decided between log intervals:
    the detectors read the host copy the Monitor makes once per ``log_every`` steps, so events
    arrive up to ``log_every`` steps late and a non-finite step is reported by metric, not by
    module (it cannot be replayed any more). Any other action for a kind (or ``sync=True``) makes
    that kind decide every step, on the host, from one small copy in the optimizer pre-step hook
    (before the update: non-finite values, gradient-norm spikes) and one at ``Monitor.step``
    (after it: loss and update-ratio spikes, drift, the optimizer-state check).

    Cost, measured against the bare Monitor on a d128 4-layer GPT (one CPU thread, batch 8×64):
    defaults about +1 % step time; per-step decisions about +2.5 % (including the every-step
    optimizer-state check); ``per_module`` about 3×. A replay costs about one extra step, on a hit only.
    """

    actions: dict[str, Any] = field(default_factory=_default_actions)
    """Per event kind (a detector's name: 'nonfinite', 'spike', 'drift', 'amp', 'attn_entropy', or a
    registered plug-in's): an action or a list of them ('warn', 'raise', 'skip', 'rollback', 'dump', or a
    registered action). Kinds not named warn."""
    detectors: tuple[str, ...] | None = None
    """Which detectors run (names in `stabkit.plugins.DETECTORS`); None = every registered one."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Settings of plug-in detectors and actions, by name: ``{"attn_entropy": {"drop": 0.5}, "rescue":
    {"lr_factor": 0.5}}`` (each plug-in's options dataclass says what it takes)."""
    sync: bool | None = None
    """Decide non-finite steps every step even when the action is 'warn' (one scalar copy per step), so
    they are localized: None = yes on a CPU (it costs nothing there), no on an accelerator (where the
    per-step copy stalls the device; `stabkit bench` measures it) — the event then says how to turn it on."""
    nonfinite: bool = True
    """Check the loss, the global gradient norm and the model output for NaN/Inf every step (device-side)."""
    check_output: bool = True
    """Per-step max of the model output (one read of the logits): finite iff log Z is finite, so log Z is checked every step."""
    optimizer_check_every: int | None = None
    """Check params + optimizer state for NaN/Inf after every N-th update (one read of both; 0 = off; None = every step when 'nonfinite' has an action other than warn, else every MonitorConfig.every)."""
    localize: bool = True
    """On a decided non-finite step, replay it with per-module checks and name the module, pass and tensor that produced it."""
    keep_output_grad: bool = True
    """Keep dL/d(output) until the optimizer step so the backward pass can be replayed (one output-sized tensor; see loss_fn)."""
    loss_fn: LossFn | None = None
    """`loss_fn(output, *args, **kwargs) -> loss` for replaying the backward pass; when set, no output gradient is kept."""
    per_module: bool = False
    """Always-on mode: per-module finite checks (forward, backward, parameter grads) on every step; costly, no replay needed."""
    spike_series: tuple[str, ...] = ("loss", "grad/global_norm", "grad/*/norm", "update/*/ratio")
    """Globs of the metrics the spike detector watches."""
    spike_window: int = 128
    """Values of each series in the rolling window (OLMo's StabilityMonitor: 128 steps)."""
    spike_sigma: float = 6.0
    """A spike is at least this many robust standard deviations above the rolling median (OLMo: mean + 6σ)."""
    spike_min_ratio: dict[str, float] = field(default_factory=_default_min_ratio)
    """Glob -> the value must also be at least this multiple of the rolling median (first matching glob wins)."""
    spike_factor: float | None = 10.0
    """A value at least this multiple of the rolling median is a spike whatever σ says (Megatron: 10×); None = off."""
    spike_min_history: int = 64
    """Values a series needs before it can spike (half the window, like OLMo-core's skip-step)."""
    score_window: int = 1000
    """OLMo 2 spike score: values in the rolling mean/std window."""
    score_sigma: float = 7.0
    """OLMo 2 spike score: distance from the rolling mean, in standard deviations, that counts as a spike."""
    drift: bool = True
    """Watch max attention logit, log Z and residual RMS for sustained growth."""
    drift_window: int = 20
    """Values (sampled steps) in the robust-slope window of each drift series."""
    attn_logit_level: float = 50.0
    """Drift on attention logits only above this max |logit| (Gemma 2 and Rybakov et al. cap at 50)."""
    attn_logit_growth: float = 0.25
    """... and when the fitted max logit grew by at least this fraction over the window."""
    logz_level: float = 10.0
    """Drift on log Z only when mean log Z is at least this many nats from log(vocab) (its value at zero logits)."""
    logz_change: float = 0.5
    """... and moved at least this many nats away over the window."""
    residual_level: float = 30.0
    """Drift on residual RMS only above this multiple of the series' first values (Rybakov et al.: 2× in diverging runs)."""
    residual_growth: float = 0.25
    """... and when the fitted RMS grew by at least this fraction over the window."""
    snapshot_every: int = 100
    """Rollback: take an in-memory snapshot of model and optimizer state every N steps (PaLM restarted ~100 steps back)."""
    snapshots: int = 2
    """Rollback: keep the K newest snapshots (memory: K × (model + optimizer state))."""
    snapshot_device: str | None = None
    """Rollback: where snapshots live (None = beside each tensor; 'cpu' saves accelerator memory at a copy cost)."""
    dump_dir: str | None = None
    """Dump: directory for batches and state reports (None = `<logdir>/stabkit-dumps`)."""

    def __post_init__(self) -> None:
        if self.sync is not None and not isinstance(self.sync, bool):
            raise ValueError(f"DetectConfig.sync must be None (auto), True or False, got {self.sync!r}")
        if self.snapshot_device is not None:
            _check_device(self.snapshot_device)
        if not isinstance(self.actions, dict):
            raise ValueError(
                f"DetectConfig.actions must be a dict kind -> action(s), got {type(self.actions).__name__}"
            )
        kinds = DETECTORS.names()
        unknown = sorted(set(self.actions) - set(kinds))
        if unknown:
            raise ValueError(f"DetectConfig.actions has unknown kind(s) {unknown}; allowed: {list(kinds)}")
        self.actions = {kind: _normalise_actions(kind, self.actions.get(kind, "warn")) for kind in kinds}
        if self.detectors is not None:
            if isinstance(self.detectors, str) or not all(isinstance(d, str) for d in self.detectors):
                raise ValueError("DetectConfig.detectors must be None or a list of detector names")
            self.detectors = tuple(self.detectors)
            missing = sorted(set(self.detectors) - set(kinds))
            if missing:
                raise ValueError(
                    f"DetectConfig.detectors names unknown detector(s) {missing}; known: {list(kinds)}"
                )
        if not isinstance(self.options, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in self.options.items()
        ):
            raise ValueError(
                'DetectConfig.options must map detector names to dicts, e.g. {"attn_entropy": {"drop": 0.5}}'
            )
        known = [*kinds, *ACTIONS.names()]
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise ValueError(
                f"DetectConfig.options names unknown detector(s) or action(s) {unknown}; known: {known}"
            )
        for name in ("spike_window", "score_window", "drift_window", "snapshot_every", "snapshots"):
            _check_int(name, getattr(self, name), 1)
        if self.optimizer_check_every is not None:
            _check_int("optimizer_check_every", self.optimizer_check_every, 0)
        _check_int("spike_min_history", self.spike_min_history, 2)
        if self.drift_window < 5:
            raise ValueError(
                f"DetectConfig.drift_window must be >= 5 (a slope needs points), got {self.drift_window}"
            )
        for name in ("spike_sigma", "score_sigma", "attn_logit_growth", "logz_change", "residual_growth"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"DetectConfig.{name} must be a number > 0, got {value!r}")
        for name in ("attn_logit_level", "logz_level", "residual_level"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"DetectConfig.{name} must be a number >= 0, got {value!r}")
        if self.spike_factor is not None and not (
            isinstance(self.spike_factor, int | float) and self.spike_factor > 1
        ):
            raise ValueError(
                f"DetectConfig.spike_factor must be None or a number > 1, got {self.spike_factor!r}"
            )
        if isinstance(self.spike_series, str) or not all(isinstance(s, str) for s in self.spike_series):
            raise ValueError(
                "DetectConfig.spike_series must be a sequence of metric-name globs, e.g. ('loss', 'grad/*/norm')"
            )
        self.spike_series = tuple(self.spike_series)
        if not isinstance(self.spike_min_ratio, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and v >= 1
            for k, v in self.spike_min_ratio.items()
        ):
            raise ValueError(
                "DetectConfig.spike_min_ratio must map metric globs to numbers >= 1, e.g. {'loss': 1.5}"
            )
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ValueError(
                "DetectConfig.loss_fn must be None or a callable loss_fn(output, *args, **kwargs) -> loss"
            )

    def min_ratio(self, series: str) -> float:
        """The minimum multiple of the rolling median a spike of `series` must reach."""
        for pattern, ratio in self.spike_min_ratio.items():
            if fnmatch.fnmatchcase(series, pattern):
                return float(ratio)
        return 1.0

    def options_for(self, name: str, options_class: type[OptionsT]) -> OptionsT:
        """`options[name]` as `options_class` (a dataclass of a plug-in's settings), at attach; a
        ValueError names the plug-in and the bad or unknown key."""
        given = dict(self.options.get(name, {}))
        known = {f.name for f in fields(options_class)}  # type: ignore[arg-type]
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(
                f"DetectConfig.options[{name!r}] has unknown key(s) {unknown}; allowed: {sorted(known)}"
            )
        try:
            return options_class(**given)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"DetectConfig.options[{name!r}]: {exc}") from exc

    def resolved(self, device_type: str) -> DetectConfig:
        """This config with `sync` decided for a model on `device_type` (called once at attach)."""
        if self.sync is not None:
            return self
        return replace(self, sync=device_type == "cpu")

    def runs(self, kind: str) -> bool:
        """True when the detector of `kind` is switched on (`detectors`, and the older switches
        `nonfinite` / `drift` for those two kinds)."""
        if (kind == "nonfinite" and not self.nonfinite) or (kind == "drift" and not self.drift):
            return False
        return self.detectors is None or kind in self.detectors

    def needs_sync(self, kind: str) -> bool:
        """True when `kind` must be decided every step on the host (an action other than warn)."""
        acts = self.actions.get(kind, ("warn",))
        return any(a != "warn" for a in acts) or (kind == "nonfinite" and bool(self.sync))


def _normalise_actions(kind: str, value: Any) -> tuple[str, ...]:
    acts = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Sequence) else None
    if not acts or not all(isinstance(a, str) and a in ACTIONS for a in acts):
        raise ValueError(
            f"DetectConfig.actions[{kind!r}] must be one of {list(ACTIONS.names())} or a list of them, got {value!r}"
        )
    return tuple(dict.fromkeys(acts))


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"DetectConfig.{name} must be an integer >= {low}, got {value!r}")


def _check_device(name: object) -> None:
    """Raise ValueError unless `name` names a device torch knows of and has here ('cpu', 'cuda:1', ...)."""
    import torch

    try:
        device = torch.device(name)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"DetectConfig.snapshot_device must be None or a torch device such as 'cpu' or 'cuda:0', got {name!r}"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"DetectConfig.snapshot_device={name!r}, but CUDA is not available here")
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(
            f"DetectConfig.snapshot_device={name!r}: snapshots can live on cpu, cuda, mps or xpu devices"
        )

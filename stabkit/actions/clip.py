"""Action 'clip': adaptive clipping before the update lands — ZClip on the gradient norm, or Levanter's
clip of the update norm — every optimizer step while it is configured.

Unlike the other actions it does not wait for an event: list it under any event kind (by convention
``spike``: ``DetectConfig(actions={"spike": ["warn", "clip"]})``) and from attach on it clips every
step by its own statistics, in optimizer step hooks (through the Monitor's hooks, owner 'clip', removed
at detach). A spike event of the step says what it did (``details["clip"]``).

Methods (`ClipOptions.method`):

- ``zclip`` (Kumar et al. 2025, arXiv 2504.02507; the reference implementation's defaults): the
  global gradient norm g is tracked by an exponential moving mean μ and variance σ² (α = 0.97),
  initialised from the first `warmup` (25) steps, which are not clipped. Afterwards, with
  z = (g − μ)/(σ + ε): when z > z_thr (2.5) the gradients are scaled to the norm μ + z_thr²·σ/z
  (``clip_to = "adaptive"``: the larger the outlier, the harder the clip) or to μ (``"mean"``);
  μ and σ² then move towards the norm used (clipped or not): μ ← αμ + (1 − α)x,
  σ² ← ασ² + (1 − α)(x − μ)² with the new μ. Runs in the step pre-hook, on the gradients the
  optimizer is about to use (after the loop's own clipping, if it has one).
- ``update_norm`` (Levanter ``clip_update_norm``): the norm u of the whole update (parameters after
  the step minus before) is clipped to mean + `sigma` (3) × std of the last `window` (128) update
  norms once `min_history` (64) are known (std at least 1e-6); the history keeps the *unclipped*
  norms, so it cannot collapse onto its own clips. It needs the parameters from before the step:
  a copy kept from the step pre-hook, **one copy of the parameters in memory**.

Each step it records ``clip/did_clip`` (1/0), ``clip/pre_norm``, ``clip/post_norm`` and, once the
statistics exist, ``clip/threshold`` (the norm above which it clips: μ + z_thr·σ for ZClip, mean +
σ·std for the update norm; ZClip also ``clip/z``). Everything stays on the device: the decision is a
``torch.where``, no host sync; a step whose update another action skipped adds nothing to the
update-norm history.

Levanter also *skips* steps whose loss or gradient norm is past mean + 6σ of the last 128: that is the
action 'skip' on the spike detector (median + 6 robust σ over 128 values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from ..distributed import like_param, local, process_group_active, reduce_now, replicas
from ..events import Event
from ..hooks import DIRECT
from ..plugins import ACTIONS
from ..tables import bounds
from .base import Action, ActionContext


@dataclass(frozen=True)
class ClipOptions:
    """``DetectConfig.options["clip"]``."""

    method: Literal["zclip", "update_norm"] = "zclip"
    """``zclip``: clip the gradient norm by its z-score (ZClip); ``update_norm``: clip the update's
    norm to mean + σ·std of the recent ones (Levanter)."""
    z_threshold: float = field(default=2.5, metadata=bounds(lo=0.0, lo_open=True))
    """ZClip: z-score above which a step is clipped."""
    alpha: float = field(default=0.97, metadata=bounds(lo=0.0, hi=1.0, lo_open=True, hi_open=True))
    """ZClip: EMA factor of the norm's mean and variance."""
    warmup: int = field(default=25, metadata=bounds(lo=1))
    """ZClip: steps whose norms initialise the mean and variance (not clipped)."""
    clip_to: Literal["adaptive", "mean"] = "adaptive"
    """ZClip: clip an outlier to μ + z_thr²·σ/z (``adaptive``, the reference's default) or to μ."""
    max_norm: float | None = field(default=None, metadata=bounds(lo=0.0, lo_open=True, hint="or none"))
    """ZClip: also never let the gradient norm exceed this (None: no fixed ceiling)."""
    sigma: float = field(default=3.0, metadata=bounds(lo=0.0, lo_open=True))
    """Update norm: clip above mean + sigma × std of the window."""
    window: int = field(default=128, metadata=bounds(lo=2))
    """Update norm: update norms in the rolling history."""
    min_history: int = field(default=64, metadata=bounds(lo=2))
    """Update norm: norms needed before it clips."""
    eps: float = field(default=1e-6, metadata=bounds(lo=0.0, lo_open=True))
    """ZClip: added to σ in the z-score."""

    def __post_init__(self) -> None:
        if self.min_history > self.window:
            raise ValueError(
                f"need min_history <= window, got min_history={self.min_history}, window={self.window}"
            )


def _params(optimizer: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _global_norm(tensors: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    """0-d float32 L2 norm of all `tensors` together (one foreach pass, no sync). Under
    torch.distributed the norm of the whole tensors, the same on every rank, so every rank clips
    alike: each rank's pieces (a DTensor gradient in its parameter's layout), a piece several ranks
    hold counted once, combined by one collective (`stabkit.distributed`)."""
    if not process_group_active():
        norms = torch._foreach_norm(tensors)
        return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    world = dist.get_world_size()
    pieces = [like_param(t, p) for t, p in zip(tensors, params, strict=True)]
    norms = torch._foreach_norm([local(t) for t in pieces])
    scaled = [n.float() / math.sqrt(replicas(t, world)) for n, t in zip(norms, pieces, strict=True)]
    return reduce_now(torch.linalg.vector_norm(torch.stack(scaled)).reshape(1), ["l2"]).reshape(())


class ZClip:
    """ZClip's state and rule (see the module docstring), on device tensors."""

    def __init__(self, o: ClipOptions) -> None:
        self.o = o
        self.seen = 0
        """Steps counted so far (host: it does not depend on the values)."""
        self.buffer: torch.Tensor | None = None
        self.mean: torch.Tensor | None = None
        self.var: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, norm: torch.Tensor) -> dict[str, torch.Tensor]:
        """The clip of one step with global gradient norm `norm` (0-d): the scale to apply to the
        gradients and what to record."""
        o = self.o
        one = torch.ones((), device=norm.device)
        out: dict[str, torch.Tensor] = {"pre_norm": norm}
        if self.mean is None or self.var is None:
            if self.buffer is None:
                self.buffer = torch.zeros(o.warmup, device=norm.device)
            self.buffer[self.seen] = norm
            self.seen += 1
            if self.seen == o.warmup:
                self.mean = self.buffer.mean()
                self.var = (self.buffer - self.mean).pow(2).mean()
            scale = one
            if o.max_norm is not None:
                scale = torch.where(norm > o.max_norm, o.max_norm / (norm + 1e-6), one)
            return {**out, "scale": scale}
        self.seen += 1
        std = self.var.sqrt()
        z = (norm - self.mean) / (std + o.eps)
        over = z > o.z_threshold
        if o.clip_to == "adaptive":
            target = self.mean + o.z_threshold**2 * std / z
        else:
            target = self.mean
        value = torch.where(over, target, norm)  # the norm the EMA takes in
        limit = value if o.max_norm is None else torch.clamp(value, max=o.max_norm)
        scale = torch.where(norm > limit, limit / (norm + 1e-6), one)
        threshold = self.mean + o.z_threshold * std
        self.mean = o.alpha * self.mean + (1 - o.alpha) * value
        self.var = o.alpha * self.var + (1 - o.alpha) * (value - self.mean).pow(2)
        return {**out, "scale": scale, "threshold": threshold, "z": z}


class UpdateNormClip:
    """Levanter's update-norm clip (see the module docstring), on device tensors."""

    def __init__(self, o: ClipOptions) -> None:
        self.o = o
        self.history: torch.Tensor | None = None
        self.count = 0
        """Norms in the history (host: counts steps, not values)."""
        self.index = 0

    @torch.no_grad()
    def step(self, norm: torch.Tensor) -> dict[str, torch.Tensor]:
        """The clip of one update of norm `norm` (0-d): its scale and what to record; then `norm`
        joins the history (unclipped)."""
        o = self.o
        if self.history is None:
            self.history = torch.zeros(o.window, device=norm.device)
        one = torch.ones((), device=norm.device)
        out: dict[str, torch.Tensor] = {"pre_norm": norm, "scale": one}
        if self.count >= o.min_history:
            past = self.history[: self.count]
            mean, std = past.mean(), past.std(unbiased=False)
            threshold = mean + o.sigma * torch.clamp(std, min=1e-6)
            out["scale"] = torch.where(norm > threshold, threshold / torch.clamp(norm, min=1e-6), one)
            out["threshold"] = threshold
        self.history[self.index] = norm
        self.index = (self.index + 1) % o.window
        self.count = min(self.count + 1, o.window)
        return out


@ACTIONS.register
class Clip(Action):
    """Adaptive clipping every optimizer step (see the module docstring)."""

    name = "clip"
    order = 25
    options_class = ClipOptions

    def __init__(self, ctx: ActionContext) -> None:
        super().__init__(ctx)
        self.options = ctx.config.options_for(self.name, ClipOptions)
        self.rule: ZClip | UpdateNormClip = (
            ZClip(self.options) if self.options.method == "zclip" else UpdateNormClip(self.options)
        )
        self._saved: list[torch.Tensor] | None = None
        self._latest: dict[str, torch.Tensor] = {}
        opt = ctx.optimizer
        if opt is not None:
            hooks = ctx.hooks or DIRECT
            if self.options.method == "zclip":
                hooks.step_pre(self.name, opt, self._clip_gradients)
            else:
                hooks.step_pre(self.name, opt, self._keep_parameters)
                hooks.step_post(self.name, opt, self._clip_update)

    # ------------------------------------------------------------------ ZClip (before the update)
    @torch.no_grad()
    def _clip_gradients(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.ctx.optimizer is not None
        params = [p for p in _params(self.ctx.optimizer) if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:  # another action skipped the update
            return
        norm = _global_norm(grads, params)
        seen = self.rule.step(norm)
        torch._foreach_mul_([local(g) for g in grads], seen["scale"])
        self._log(seen, norm * seen["scale"])

    # ------------------------------------------------------------------ update norm (after it)
    @torch.no_grad()
    def _keep_parameters(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.ctx.optimizer is not None
        params = _params(self.ctx.optimizer)
        if self._saved is None or len(self._saved) != len(params):
            self._saved = [torch.empty_like(p) for p in params]
        torch._foreach_copy_(self._saved, params)

    @torch.no_grad()
    def _clip_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        assert self.ctx.optimizer is not None
        params = _params(self.ctx.optimizer)
        if self._saved is None or len(self._saved) != len(params):
            return
        if all(p.grad is None for p in params):  # the update was skipped: nothing to measure
            return
        deltas = list(torch._foreach_sub(params, self._saved))
        norm = _global_norm(deltas, params)
        seen = self.rule.step(norm)
        scale = seen["scale"]
        clipped = scale < 1
        for p, before, delta in zip(params, self._saved, deltas, strict=True):
            p, before, delta = local(p), local(before), local(delta)  # DTensors: this rank's pieces
            p.copy_(torch.where(clipped, before + delta * scale.to(delta.dtype), p))
        self._log(seen, norm * scale)

    def _log(self, seen: dict[str, torch.Tensor], post: torch.Tensor) -> None:
        latest = {
            "clip/did_clip": (seen["scale"] < 1).float(),
            "clip/pre_norm": seen["pre_norm"],
            "clip/post_norm": post,
        }
        if "threshold" in seen:
            latest["clip/threshold"] = seen["threshold"]
        if "z" in seen:
            latest["clip/z"] = seen["z"]
        self._latest = latest
        if self.ctx.record is not None:
            for name, value in latest.items():
                self.ctx.record(name, value)

    def run(self, event: Event, before_update: bool) -> bool:
        o = self.options
        rule = (
            f"ZClip (z > {o.z_threshold:g}, EMA α {o.alpha:g})"
            if o.method == "zclip"
            else f"update-norm clip (mean + {o.sigma:g}σ of the last {o.window})"
        )
        event.details["clip"] = f"clipped by its own statistics every step: {rule}; see clip/* metrics"
        return False

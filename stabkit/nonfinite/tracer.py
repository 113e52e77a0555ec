"""`FiniteTracer`: per-module finite checks that name the first module that *produced* NaN/Inf.

Hooks on every module (and parameter), kept on the device: each hook appends one 0-d bool
"produced here" flag, in the order the hooks fire, so the first True flag is the origin.

- forward hook: the module's output holds NaN/±Inf while its inputs (positional and keyword,
  floating point) hold no NaN/+Inf. −Inf in inputs is allowed: additive attention masks use it.
- full backward hook: grad_input holds NaN/Inf while grad_output is finite.
- parameter tensor hook: the parameter's gradient holds NaN/Inf while the grad_output of the
  module that owns it was finite (recorded by a full backward *pre*-hook).

Used for a few moments during a replay (`localize.py`) and, in the always-on mode
(`DetectConfig.per_module`), on every step. No host sync: `first()` returns device tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..discovery.trace import tracing
from ..distributed.context import local
from ..hooks import DIRECT, Registrar
from ..stats.finite import floating_tensors, nonfinite_flag

Site = tuple[str, str, str]
"""(module path, pass 'forward'|'backward', tensor 'output'|'grad_input'|'grad of <param>')."""


class FiniteTracer:
    """Registers the checks on `model`; `detach()` removes them (safe twice)."""

    def __init__(self, model: nn.Module, backward: bool = True, hooks: Registrar = DIRECT) -> None:
        self.model = model
        self.backward = backward
        self.sites: list[Site] = []
        self.flags: list[torch.Tensor] = []
        self._grad_out_bad: dict[str, torch.Tensor] = {}
        self.handles: list[RemovableHandle] = []
        self.owner: dict[int, tuple[str, str]] = {}
        for path, module in model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                self.owner.setdefault(id(p), (path, f"{path}.{pname}" if path else pname))
        for path, module in model.named_modules():
            self.handles.append(hooks.forward("tracer", module, self._forward_hook(path), with_kwargs=True))
            if backward:
                self.handles.append(hooks.backward_pre("tracer", module, self._backward_pre_hook(path)))
                self.handles.append(hooks.backward("tracer", module, self._backward_hook(path)))
        if backward:
            for p in model.parameters():
                if p.requires_grad:
                    self.handles.append(hooks.gradient("tracer", p, self._param_hook(p)))

    def _add(self, site: Site, flag: torch.Tensor | None) -> None:
        if flag is not None:
            self.sites.append(site)
            self.flags.append(flag)

    def _forward_hook(self, path: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if tracing():
                return
            with torch.no_grad():
                out_bad = nonfinite_flag(floating_tensors(output))
                if out_bad is None:
                    return
                in_bad = nonfinite_flag(floating_tensors(args) + floating_tensors(kwargs), ignore_neginf=True)
                self._add((path, "forward", "output"), out_bad if in_bad is None else out_bad & ~in_bad)

        return hook

    def _backward_pre_hook(self, path: str) -> Any:
        def hook(module: nn.Module, grad_output: Any) -> None:
            bad = nonfinite_flag([g for g in grad_output if g is not None])
            if bad is not None:
                self._grad_out_bad[path] = bad

        return hook

    def _backward_hook(self, path: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            in_bad = nonfinite_flag([g for g in grad_input if g is not None])
            if in_bad is None:
                return
            out_bad = nonfinite_flag([g for g in grad_output if g is not None])
            self._add((path, "backward", "grad_input"), in_bad if out_bad is None else in_bad & ~out_bad)

        return hook

    def _param_hook(self, p: nn.Parameter) -> Any:
        path, name = self.owner.get(id(p), ("", "?"))

        def hook(grad: torch.Tensor) -> None:
            with torch.no_grad():
                bad = ~torch.isfinite(local(grad)).all()  # a DTensor gradient: this rank's piece
                upstream = self._grad_out_bad.get(path)
                self._add((path, "backward", f"grad of {name}"), bad if upstream is None else bad & ~upstream)

        return hook

    def first(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(any flag set, index of the first set flag) as 0-d device tensors; (False, 0) with no flags."""
        if not self.flags:
            return torch.zeros((), dtype=torch.bool), torch.zeros((), dtype=torch.long)
        device = self.flags[0].device
        flags = torch.stack([f.to(device) for f in self.flags])
        return flags.any(), flags.int().argmax()  # argmax returns the first maximal index

    def result(self) -> Site | None:
        """The first producing site, read on the host (one sync)."""
        hit, index = self.first()
        return self.sites[int(index)] if bool(hit) else None  # sync point (only during a replay / on a hit)

    def reset(self) -> None:
        """Forget the recorded flags (call between steps in always-on mode)."""
        self.sites, self.flags, self._grad_out_bad = [], [], {}

    def detach(self) -> None:
        """Remove every hook (safe to call twice)."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> FiniteTracer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

"""Make Python-level attention entry points visible to ``TorchFunctionMode``s, reversibly.

A torch op call reaches every active ``TorchFunctionMode``; a plain Python function
(``xformers.ops.memory_efficient_attention``, Transformer Engine's ``DotProductAttention.forward``, a
user's own kernel wrapper) does not. `install` replaces each registered entry point — the attribute
where it is defined and every reference to the same function object in loaded modules (``from x
import f`` copies) — by a wrapper that, while any function mode is active, routes the call through
``torch.overrides.handle_torch_function``, exactly as torch's own functions do; with no mode active it
calls the original directly (one C call of overhead). The wrapper computes nothing else, so
training is unchanged. Only libraries already imported are touched (stabkit never imports them).

``torch.compile`` wrappers of the entry points made before `install` (``torch.compile(flex_attention)``)
are found in module globals and on the given model (`compiled`) and wrapped the same way.

Installed when something needs to see kernels (a monitor at attach, discovery's traced forward, an
intervention that changes kernel calls) and uninstalled when the last of them is done: `install`
returns a handle; handles are counted.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import compiled
from .base import KERNELS, forget_wrapper, note_wrapper


@dataclass
class _Patched:
    original: Callable[..., Any]
    wrapper: Callable[..., Any]
    kernel: str
    places: list[tuple[Any, str]] = field(default_factory=list)
    """(namespace object, attribute) pairs that now hold the wrapper."""


_PATCHED: dict[str, _Patched] = {}
_USERS = [0]


def make_visible(original: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper of `original` that function modes see as one call (its identity is the wrapper)."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._is_torch_function_mode_enabled():
            tensors = tuple(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            return torch.overrides.handle_torch_function(wrapper, tensors, *args, **kwargs)
        return original(*args, **kwargs)

    wrapper.__stabkit_original__ = original  # type: ignore[attr-defined]
    return wrapper


def resolve(target: str) -> tuple[Any, str, Any] | None:
    """(owner object, attribute, current value) of ``module:qualname`` when its module is loaded."""
    module_name, _, qualname = target.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        return None
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    value = getattr(owner, parts[-1], None)
    return (owner, parts[-1], value) if value is not None else None


def _patch(target: str, kernel: str) -> None:
    if target in _PATCHED:
        return
    found = resolve(target)
    if found is None:
        return
    owner, attr, value = found
    if hasattr(value, "__stabkit_original__"):
        return  # the same function, wrapped already under another of the kernel's import paths
    original = value
    wrapper = make_visible(original)
    patched = _Patched(original, wrapper, kernel)
    setattr(owner, attr, wrapper)
    patched.places.append((owner, attr))
    if not isinstance(owner, type):  # a module-level function: also the copies other modules imported
        for module in list(sys.modules.values()):
            space = getattr(module, "__dict__", None)
            if not isinstance(space, dict) or module is owner:
                continue
            for name, item in list(space.items()):
                if item is original:
                    setattr(module, name, wrapper)
                    patched.places.append((module, name))
    note_wrapper(wrapper, kernel)
    _PATCHED[target] = patched


def _patch_compiled(roots: Iterable[nn.Module]) -> None:
    """Wrap every ``torch.compile`` wrapper of a wrapped entry point (`compiled.find`)."""
    watched = {}
    for entry in _PATCHED.values():
        if compiled.compiled_from(entry.original) is None:
            watched[id(entry.original)] = entry.kernel
            watched[id(entry.wrapper)] = entry.kernel  # compiled while a monitor was attached
    if not watched:
        return
    for owner, attr, fn, kernel in compiled.find(watched, roots):
        key = f"compiled@{id(fn)}"
        if key not in _PATCHED:
            _PATCHED[key] = _Patched(fn, make_visible(fn), kernel)
            note_wrapper(_PATCHED[key].wrapper, kernel)
        setattr(owner, attr, _PATCHED[key].wrapper)
        _PATCHED[key].places.append((owner, attr))


def _unpatch_all() -> None:
    for patched in _PATCHED.values():
        for owner, attr in patched.places:
            if getattr(owner, attr, None) is patched.wrapper:
                setattr(owner, attr, patched.original)
        for module in list(sys.modules.values()):  # copies imported while the wrapper was in place
            space = getattr(module, "__dict__", None)
            if isinstance(space, dict):
                for name, item in list(space.items()):
                    if item is patched.wrapper:
                        setattr(module, name, patched.original)
        forget_wrapper(patched.wrapper)
    _PATCHED.clear()


class EntryPoints:
    """A hold on the installed wrappers; `remove` releases it (safe twice; a context manager)."""

    def __init__(self) -> None:
        self._held = True

    def remove(self) -> None:
        if self._held:
            self._held = False
            _USERS[0] -= 1
            if _USERS[0] == 0:
                _unpatch_all()

    def __enter__(self) -> EntryPoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install(roots: Iterable[nn.Module] = ()) -> EntryPoints:
    """Wrap the Python entry points of every registered kernel whose module is loaded (again at each
    call: a library imported since is picked up), and the ``torch.compile`` wrappers of them held in
    module globals or by the models in `roots` (their modules and classes). Returns a hold to
    `remove` when done."""
    _USERS[0] += 1
    for kernel in list(KERNELS.values()):
        for target in kernel.functions:
            _patch(target, kernel.name)
    _patch_compiled(roots)
    return EntryPoints()


def import_target(target: str) -> Callable[..., Any]:
    """Import ``module:qualname`` (for `register_kernel` given a string)."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def active() -> bool:
    """True while some monitor, trace or intervention holds the wrappers installed."""
    return _USERS[0] > 0

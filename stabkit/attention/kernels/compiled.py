"""Find ``torch.compile`` wrappers of kernel entry points made before stabkit attached.

``torch.compile(flex_attention)`` — the normal way FlexAttention runs on a GPU — returns a new
function (Dynamo's ``compile_wrapper``, which keeps the function it compiles as
``_torchdynamo_orig_callable``). Code that made it before `stabkit.attach` calls that new function,
never the entry point `entry_points` wrapped, so no function mode would see the call. `find` looks
for such wrappers of the entry points stabkit watches in the places a model keeps them:

- module globals of every loaded module (``flex = torch.compile(flex_attention)``, also the shadowing
  ``flex_attention = torch.compile(flex_attention)``, and ``from mod import flex`` copies);
- class attributes of the given model's module classes and their bases (torchtitan's
  ``FlexAttentionWrapper._compiled_flex_attn``);
- attributes of the given model's modules (``self.flex = torch.compile(flex_attention)``).

A wrapper held anywhere else (a closure, a dict) is not found: keep it in one of these places.
`entry_points.install` wraps each one found as it wraps the entry points themselves; the compiled
function still runs every call, with the arguments it was given (observation changes nothing).

Runs at install (attach, discovery's traced forward, an intervention's apply): one pass over the
loaded modules' globals, no per-step work.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from torch import nn


def compiled_from(item: Any) -> Callable[..., Any] | None:
    """The function `item` compiles when `item` is ``torch.compile``'s wrapper of a plain function
    (not one of stabkit's own visible wrappers), else None."""
    if type(item) is not types.FunctionType or "__stabkit_original__" in item.__dict__:
        return None
    found: Callable[..., Any] | None = item.__dict__.get("_torchdynamo_orig_callable")
    return found


def _namespaces(roots: Iterable[nn.Module]) -> Iterator[tuple[Any, Mapping[str, Any]]]:
    """(owner, its attributes) of every place `find` looks."""
    for module in list(sys.modules.values()):
        space = getattr(module, "__dict__", None)
        if isinstance(space, dict):
            yield module, space
    classes: dict[type, None] = {}
    for root in roots:
        for sub in root.modules():
            yield sub, sub.__dict__
            classes.update(dict.fromkeys(c for c in type(sub).__mro__ if c not in (nn.Module, object)))
    for cls in classes:
        yield cls, vars(cls)


def find(
    entry_points: Mapping[int, str], roots: Iterable[nn.Module] = ()
) -> list[tuple[Any, str, Callable[..., Any], str]]:
    """(owner, attribute, compiled wrapper, kernel name) for every compiled wrapper of a function in
    `entry_points` (id of the function -> its kernel's name) held where the module docstring says."""
    found = []
    for owner, space in _namespaces(roots):
        for name, item in list(space.items()):
            compiled = compiled_from(item)
            if compiled is not None and id(compiled) in entry_points:
                found.append((owner, name, item, entry_points[id(compiled)]))
    return found

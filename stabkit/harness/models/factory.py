"""`module:callable`: the user's own model factory (``my_pkg.models:build`` or ``path/to/file.py:build``).

Runs when a worker (or `stabkit inspect` / `bench`) builds the model. The factory is called with the
keyword arguments it accepts among `FACTORY_ARGUMENTS` (all of them when it takes ``**kwargs``), the
user's options over them, and must return an ``nn.Module`` whose ``forward(tokens)`` (tokens: long,
(batch, seq)) returns the logits (batch, seq, vocab_size): a tensor, an object with ``.logits``, or a
tuple whose first element is them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from .config import GPTConfig
from .spec import ModelSpecError

FACTORY_ARGUMENTS = (
    "vocab_size",
    "context",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "dropout",
)
"""What a factory may take, by keyword, from the recipe's size (``context``: the sequence length)."""


def load_factory(target: str) -> Callable[..., Any]:
    """The callable named ``module:attr`` (a dotted module, importable from the working directory, or
    a ``.py`` file); a one-line ModelSpecError when the module or the name is missing."""
    module_name, _, attr = target.rpartition(":")
    try:
        if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
            module = load_file(Path(module_name))
        else:
            if os.getcwd() not in sys.path:  # `stabkit` runs as a console script: cwd is not on the path
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(
            f"model spec {target!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc})"
        ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelSpecError(f"model spec {target!r}: {module_name!r} has no callable {attr!r}")
    return factory


def load_file(path: Path) -> Any:
    """The module in the file `path` (imported once per process, under a name derived from the path)."""
    if not path.is_file():
        raise ModelSpecError(f"model spec: file {str(path)!r} does not exist")
    name = "stabkit_user_model_" + "".join(c if c.isalnum() else "_" for c in str(path.resolve()))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelSpecError(f"model spec: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def factory_arguments(size: GPTConfig) -> dict[str, Any]:
    """`FACTORY_ARGUMENTS` read off the recipe's size."""
    return {
        "vocab_size": size.vocab_size,
        "context": size.context,
        "d_model": size.d_model,
        "n_layers": size.n_layers,
        "n_heads": size.n_heads,
        "n_kv_heads": size.kv_heads,
        "d_ff": size.ff_width,
        "dropout": size.dropout,
    }


def accepted(factory: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The part of `offered` that `factory` takes by keyword (all of it with ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in offered.items() if k in names}


def build_callable(target: str, size: GPTConfig, options: dict[str, Any]) -> nn.Module:
    """The user's model at the recipe's size (random init from the current torch seed)."""
    factory = load_factory(target)
    kwargs = {**accepted(factory, factory_arguments(size)), **options}
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise ModelSpecError(
            f"model spec {target!r}: calling it with {sorted(kwargs)} failed: {exc}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"model spec {target!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model

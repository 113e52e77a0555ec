"""Eager attention whose softmax input is not the logits themselves: rows shifted by their max, and
learned sink columns (GPT-OSS: ``cat([logits + mask, sinks]) - rowmax`` before the softmax).

Discovery marks such call sites (`AttentionMap.softmax_shift`, `AttentionMap.sink_columns`, read from
the traced forward). On sampled steps, inside those attention modules only, the probe's scope also
routes the row-max (``Tensor.max``/``amax``) and subtraction calls here: `EagerTracker` remembers
``values = x.max(-1, keepdim=True)`` and ``y = x - values``, so that at the softmax of ``y`` the probe
reads ``x`` — the true logits, whose max is the max logit (a shifted row only gives its range). The
references are dropped when the module's forward ends. Nothing is computed; every call proceeds
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..call import LogitsCall
from ..readers import read_softmax

ROW_MAXES: tuple[Callable[..., Any], ...] = (torch.Tensor.max, torch.max, torch.Tensor.amax, torch.amax)
SUBTRACTIONS: tuple[Callable[..., Any], ...] = (torch.Tensor.sub, torch.sub, torch.Tensor.__sub__)


def _is_row_max(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return dim in (-1, 3, [-1], (-1,)) and bool(keep)


class EagerTracker:
    """Per attention module, the row maxima and shifted tensors of the forward in progress."""

    def __init__(self, sink_columns: Mapping[str, int]) -> None:
        self.sink_columns = dict(sink_columns)
        self._maxes: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._shifted: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def on_row_max(
        self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Handler of ``max``/``amax`` inside a tracked module: remember ``values -> x``."""
        out = func(*args, **kwargs)
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() == 4 and _is_row_max(args, kwargs):
            values = out[0] if isinstance(out, tuple) else out
            if isinstance(values, torch.Tensor):
                self._maxes.setdefault(path, {})[id(values)] = (x, values)
        return out

    def on_sub(
        self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Handler of subtractions inside a tracked module: remember ``x - rowmax(x) -> x``."""
        out = func(*args, **kwargs)
        if len(args) >= 2 and isinstance(out, torch.Tensor):
            seen = self._maxes.get(path, {}).get(id(args[1]))
            if seen is not None and seen[0] is args[0] and seen[1] is args[1]:
                self._shifted.setdefault(path, {})[id(out)] = (args[0], out)
        return out

    def read(self, path: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> LogitsCall:
        """The softmax call of a tracked module, with the unshifted logits and its sink columns."""
        call = read_softmax(args, kwargs)
        shifted = self._shifted.get(path, {}).get(id(call.x))
        if shifted is not None and shifted[1] is call.x:
            call = LogitsCall(shifted[0])
        call.sink_columns = self.sink_columns.get(path, 0)
        return call

    def end(self, path: str) -> None:
        """The module's forward ended: drop the references."""
        self._maxes.pop(path, None)
        self._shifted.pop(path, None)

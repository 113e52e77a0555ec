"""The statistics as ops ``torch.compile`` treats as opaque: ``torch.ops.stabkit.*``.

When it runs: a probe's forward hook calls these only while Dynamo traces it (sampled steps of a
compiled model); the op then runs, as one node of the compiled graph, each time that graph runs.

Why opaque rather than traced: traced statistics are fused by Inductor into the model's own kernels,
so the sampled graph's kernels differ from the unsampled graph's and both are compiled from scratch
(measured on the bench's tiny GPT, cold: compile time 2.2× the bare model's); as ops they add no
generated code, the two graphs share every kernel, and the numbers are those of eager monitoring
bit for bit (the op body is the eager code: `reductions.tensor_stats`, `reductions.logit_stats`).
Each op returns one float32 vector in `Recorder.add_packed`'s form: the values as a Recorder slot
keeps them (squares for 'rms') and, last, the count 1 — one graph output per call, no arithmetic in
the graph. Cost: the eager kernels on sampled steps (one extern call each; capturable by CUDA
graphs: no host sync on an accelerator).

Gates: an op called with ``gate`` ≥ 0 first asks the registered gate (`open_gate`: a
`stabkit.probes.phase.StepPhase` of a gated, one-graph monitor) whether its cadence ``every``
samples the step in progress — a Python read at run time, invisible to Dynamo — and otherwise
returns zeros at once (the Recorder drops them). ``gate`` −1: always measure (the caller's graph
exists for sampled steps only). A closed gate (the monitor detached) measures nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from .outliers import outlier_stats
from .recorder import Combine
from .reductions import logit_stats, tensor_stats

LIBRARY = torch.library.Library("stabkit", "DEF")
"""The ``stabkit`` op namespace. Ops are defined on it directly (`opaque_op`) rather than with
``torch.library.custom_op``, whose Python layers made each call cost 11 µs warm and ~90 µs between a
compiled model's kernels (cold caches) against 4 / 35 µs here — and a closed gate's op is still
called on every step of a gated graph (21 calls per step of the small GPT under default monitoring)."""


def opaque_op(name: str, schema: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: define ``stabkit::<name><schema>`` with the function as its kernel for every device
    (CompositeExplicitAutograd: no autograd — the ops read detached values and return statistics).
    Call the op as ``torch.ops.stabkit.<name>``; give its shape function with `opaque_fake`."""

    def define(kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        LIBRARY.define(name + schema)
        LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        return kernel

    return define


def opaque_fake(name: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorator: the shape function (fake kernel) of ``stabkit::<name>``, for tracing."""

    def register(fake: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        torch.library.register_fake(f"stabkit::{name}", fake, lib=LIBRARY)
        return fake

    return register


_GATES: dict[int, Callable[[int], bool]] = {}
_KEYS = itertools.count()


def open_gate(sampled: Callable[[int], bool]) -> int:
    """Register `sampled(every) -> bool` (asked by the ops at run time); returns its key."""
    key = next(_KEYS)
    _GATES[key] = sampled
    return key


def close_gate(key: int) -> None:
    """Unregister a gate (safe twice): ops with its key measure nothing from now on."""
    _GATES.pop(key, None)


def gate_open(gate: int, every: int) -> bool:
    """Run time, inside an op: whether to measure (see the module docstring)."""
    if gate < 0:
        return True
    sampled = _GATES.get(gate)
    return sampled is not None and sampled(every)


TENSOR_COMBINES: tuple[Combine, ...] = ("rms", "max", "sum")
"""How the entries of `tensor_stats_packed` combine over micro-batches (rms, abs-max, non-finite count)."""
OUTLIER_COMBINES: tuple[Combine, ...] = ("max", "last", "mean")
"""How the entries of `outlier_stats_packed` combine (massive ratio, its channel, channel-RMS kurtosis)."""
LOGIT_COMBINES: tuple[Combine, ...] = ("max", "mean", "max", "mean")
"""How the entries of `logit_stats_packed` combine (max |logit|, mean log Z, max log Z, mean logit)."""


@opaque_op("tensor_stats", "(Tensor x, int gate, int every) -> Tensor")
def tensor_stats_packed(x: torch.Tensor, gate: int, every: int) -> torch.Tensor:
    """(4,) float32: rms², abs-max, non-finite count of `x`, and the count 1 (see the module doc)."""
    if not gate_open(gate, every):
        return torch.zeros(4, device=x.device)
    with torch.no_grad():
        return tensor_values(x)


def packed(values: list[torch.Tensor]) -> torch.Tensor:
    """`values` (0-d, on one device) and the count 1, as one float32 vector (`Recorder.add_packed`):
    what every stabkit op returns, and what a probe traces in its place."""
    one = torch.ones((), device=values[0].device)
    return torch.stack([*(v.reshape(()).float() for v in values), one])


def tensor_values(x: torch.Tensor) -> torch.Tensor:
    """(4,) float32: `tensor_stats` of `x` as rms², abs-max, non-finite count and the count 1 (the
    op's result; traced into the graph itself when a probe measures every step)."""
    rms, absmax, nonfinite = tensor_stats(x)
    return packed([rms * rms, absmax, nonfinite.to(rms.device)])


@opaque_fake("tensor_stats")
def _(x: torch.Tensor, gate: int, every: int) -> torch.Tensor:
    return x.new_empty((4,), dtype=torch.float32)


@opaque_op("logit_stats", "(Tensor logits, int gate, int every) -> Tensor")
def logit_stats_packed(logits: torch.Tensor, gate: int, every: int) -> torch.Tensor:
    """(5,) float32: max |logit|, mean log Z, max log Z, mean logit, and the count 1."""
    if not gate_open(gate, every):
        return torch.zeros(5, device=logits.device)
    with torch.no_grad():
        return logit_values(logits)


def logit_values(logits: torch.Tensor) -> torch.Tensor:
    """(5,) float32: `logit_stats` of `logits` packed with the count 1 (the op's result; traced into
    the graph itself when the probe measures every step)."""
    return packed(list(logit_stats(logits)))


@opaque_fake("logit_stats")
def _(logits: torch.Tensor, gate: int, every: int) -> torch.Tensor:
    return logits.new_empty((5,), dtype=torch.float32)


@opaque_op("outlier_stats", "(Tensor x, int gate, int every) -> Tensor")
def outlier_stats_packed(x: torch.Tensor, gate: int, every: int) -> torch.Tensor:
    """(4,) float32: massive ratio, massive dim, channel-RMS kurtosis of `x` (`stabkit.stats.outliers`),
    and the count 1."""
    if not gate_open(gate, every):
        return torch.zeros(4, device=x.device)
    with torch.no_grad():
        return outlier_values(x)


def outlier_values(x: torch.Tensor) -> torch.Tensor:
    """(4,) float32: `outlier_stats` of `x` packed with the count 1 (the op's result; traced into the
    graph itself when a probe measures every step)."""
    return packed(list(outlier_stats(x)))


@opaque_fake("outlier_stats")
def _(x: torch.Tensor, gate: int, every: int) -> torch.Tensor:
    return x.new_empty((4,), dtype=torch.float32)

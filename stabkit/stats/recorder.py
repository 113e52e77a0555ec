"""`Recorder`: keeps each step's statistics as device tensors and copies them to the host once
per log interval.

`add` runs inside hooks (forward, backward, optimizer): it only does tensor arithmetic on the
device. `commit` runs at `Monitor.step`. `drain` runs once per log interval and is the single
host copy (one `.cpu()` per device).

Under ``torch.compile`` the forward hooks' records are traced into the model's graph: each is a
tensor the graph returns (Dynamo replays the dict updates after the graph ran), so nothing leaves
the graph early and nothing breaks it. A traced record is a *pack* (`add_packed`): one float32
vector holding several statistics as a slot keeps them (squares for 'rms') and, last, their count —
the form the opaque ops of `stabkit.stats.opaque` return, so a sampled graph does no arithmetic of
its own; a traced `add` makes a pack of one. The traced code reads only whether the pack was
already recorded in this step: the first micro-batch of a step and the later ones are two graph
variants, whatever the number of micro-batches (the later ones merge vectors in the graph; counts
are entries of the vector, never Python values Dynamo would guard on). Packs become ordinary
entries (and their cross-rank reductions are registered) at the next eager call: `current`,
`current_names`, `commit`.

Eager hooks may also hand their finishing work to the recorder (`defer`): a hook keeps only the
reductions that must read its tensor, and the small ops that turn them into statistics run once for
all modules, as vectors (`add_vector`), at the next eager read. Between a model's large kernels each
small op runs with cold caches (~20–60 µs on a CPU instead of ~3): on the small reference GPT in full
monitoring, the activation probe's per-module finishing cost ~4 % of a step; batched, a few ops.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from ..distributed.context import plain

Combine = Literal["max", "min", "sum", "mean", "rms", "last"]
"""How values recorded several times within one step (micro-batches) combine."""
Reduction = Literal["mean", "sum", "max", "min", "l2", "rms"]
"""How a metric combines across ranks (declared per metric; used by distributed support)."""
Reducer = Callable[[torch.Tensor, list[Reduction]], torch.Tensor]
"""Combines a stacked 1-d tensor of values across ranks, each entry by its declared Reduction."""


@dataclass
class _Slot:
    value: torch.Tensor
    count: int | torch.Tensor
    """Values combined so far (a 0-d device tensor for values that came in a pack)."""
    combine: Combine


@dataclass
class _Vector:
    """Statistics recorded at once (`Recorder.add_vector`) and kept as one vector through the step
    while no other record of any of their names comes in (then they become slots: `_explode`)."""

    names: tuple[str, ...]
    stored: torch.Tensor
    """(k,) float32 in slot form (squares for 'rms'), each standing for `counts` measurements."""
    combine: Combine
    repeats: _Repeats | None = None
    """None: each entry stands for one measurement. Else a name recorded several times in one vector
    (a module called twice, micro-batches finished together) is one entry of ``repeats.counts``."""

    def finished(self) -> torch.Tensor:
        """(k,) the values `_finish` gives the slots (a division by a count of 1, exact, is skipped)."""
        value = self.stored
        if self.repeats is not None and self.combine in ("mean", "rms"):
            value = value / self.repeats.count_tensor
        return torch.sqrt(value) if self.combine == "rms" else value

    def count(self, i: int) -> int:
        """Measurements entry `i` stands for."""
        return 1 if self.repeats is None else self.repeats.counts[i]


@dataclass(frozen=True)
class _Repeats:
    """How a vector whose names repeat folds into one entry per name (`Recorder.add_vector`), in the
    order each name first comes: `index` (k,) maps entries to names, `last` picks each name's last."""

    names: tuple[str, ...]
    counts: tuple[int, ...]
    index: torch.Tensor
    """(k,) int64, on the vector's device."""
    last: torch.Tensor
    """(u,) int64: the entry of each name's last record."""
    count_tensor: torch.Tensor
    """(u,) float32 `counts`, on the vector's device."""

    @staticmethod
    def of(names: tuple[str, ...], device: torch.device) -> _Repeats:
        unique = {name: u for u, name in enumerate(dict.fromkeys(names))}  # in order of first record
        last = {name: i for i, name in enumerate(names)}  # keeps first-record order, holds the last i
        counts = Counter(names)
        return _Repeats(
            tuple(unique),
            tuple(counts[name] for name in unique),
            torch.tensor([unique[name] for name in names]).to(device, non_blocking=True),
            torch.tensor(list(last.values())).to(device, non_blocking=True),
            torch.tensor([counts[name] for name in unique], dtype=torch.float32).to(
                device, non_blocking=True
            ),
        )

    def fold(self, values: torch.Tensor, combine: Combine) -> torch.Tensor:
        """(u,) the entries of (k,) `values` combined per name in slot form (in record order, as
        `Recorder._merge` would: sums of squares for 'rms', max/min, the last for 'last')."""
        if combine == "last":
            return values.index_select(0, self.last)
        if combine in ("max", "min"):
            out = values.new_empty(len(self.names))
            reduce = "amax" if combine == "max" else "amin"
            return out.scatter_reduce_(0, self.index, values, reduce, include_self=False)
        return values.new_zeros(len(self.names)).index_add_(0, self.index, values)


_Pack = tuple[torch.Tensor, tuple[Combine, ...], tuple[Reduction, ...], int | None]
"""Statistics recorded together under torch.compile (see the module docstring): (values, combines,
reductions, every). values (k + 1,) float32: each statistic as its slot keeps it, then the count;
every: the gated ops' cadence — kept only when `Recorder.gate` says the step samples it (None:
kept). A plain tuple, not a dataclass: Dynamo replays the packs a traced forward records after
every run of its graph, and rebuilds a tuple in one bytecode op where an object costs a ``__new__``
and a Python ``setattr`` call per field (22 packs a step on the small GPT: ~0.1 ms)."""


class Recorder:
    """Per-step device statistics, committed per step and drained to the host per log interval."""

    def __init__(self, reducer: Reducer | None = None) -> None:
        self.reducer = reducer
        """Called by `drain` on each device's stacked values before the host copy (cross-rank reduce)."""
        self._current: dict[str, _Slot] = {}
        self._packs: dict[tuple[str, ...], _Pack] = {}
        self.gate: Callable[[int], bool] | None = None
        """Whether the step in progress samples a cadence (`StepPhase.on`, set by the probes'
        context): packs recorded with a cadence are dropped on steps it does not sample."""
        self._pending: list[tuple[int, list[tuple[tuple[str, ...], torch.Tensor]]]] = []
        self._vectors: list[tuple[tuple[str, ...], torch.Tensor, Combine, Reduction]] = []
        self._whole: dict[int, _Vector] = {}
        """Vectors of the step kept whole (one op finishes them, one `cat` commits them), by id."""
        self._in_whole: dict[str, int] = {}
        """Name -> the id of the whole vector that holds it."""
        self._deferred: dict[Callable[[], None], None] = {}
        self._repeats: dict[tuple[tuple[str, ...], torch.device], _Repeats] = {}
        """How each vector of repeated names seen so far folds (the same every step)."""
        self._names: dict[tuple[str, ...], tuple[str, ...]] = {}
        self.reductions: dict[str, Reduction] = {}
        """Cross-rank reduction declared by each metric name seen so far."""
        self.derivations: dict[str, Callable[[dict[str, float]], None]] = {}
        """Host statistics made from parts after the cross-rank reduction (`derive`), by key."""

    def add(
        self,
        name: str,
        value: torch.Tensor,
        combine: Combine = "last",
        reduction: Reduction = "mean",
        every: int | None = None,
    ) -> None:
        """Record a 0-d statistic for the current step (called from hooks; no host sync). A DTensor
        (a loss under tensor parallelism's loss_parallel) is recorded as this rank's plain value.
        `every`: a statistic of that cadence — traced code, which measures it on every step (reading
        the step would make Dynamo guard on it), records a pack the next eager read drops on the
        steps the cadence does not sample (`gate`); eagerly the caller records it on those steps only."""
        value = plain(value)
        if value.requires_grad:
            value = value.detach()
        if value.dim():
            value = value.reshape(())
        if value.dtype != torch.float32:
            value = value.float()
        if torch.compiler.is_compiling():  # a pack of one (see the module docstring)
            kept = value * value if combine == "rms" else value
            packed = torch.stack([kept, torch.ones_like(kept)])
            self.add_packed((name,), (combine,), (reduction,), packed, every=every)
            return
        self._merge(name, value * value if combine == "rms" else value, 1, combine, reduction)

    def _merge(
        self,
        name: str,
        stored: torch.Tensor,
        count: int | torch.Tensor,
        combine: Combine,
        reduction: Reduction,
    ) -> None:
        """Combine a value in slot form (a square for 'rms') standing for `count` measurements into
        the slot of `name`."""
        self.reductions.setdefault(name, reduction)
        if name in self._in_whole:
            self._explode(self._in_whole[name])
        slot = self._current.get(name)
        if slot is None or combine == "last":
            self._current[name] = _Slot(stored, count, combine)
            return
        if combine == "max":
            slot.value = torch.maximum(slot.value, stored)
        elif combine == "min":
            slot.value = torch.minimum(slot.value, stored)
        else:  # sum, mean, rms (kept as a sum of squares)
            slot.value = slot.value + stored
        slot.count = slot.count + count

    def add_vector(
        self,
        names: tuple[str, ...],
        values: torch.Tensor,
        combine: Combine = "last",
        reduction: Reduction = "mean",
    ) -> None:
        """Record the statistics `names` at once from a (k,) device tensor (one per name, all combining
        and reducing alike); they become entries at the next eager read (no host sync)."""
        self._vectors.append((names, values, combine, reduction))

    def derive(self, key: str, make: Callable[[dict[str, float]], None]) -> None:
        """Register (once per `key`) `make(row)`: run on every host row `drain` and `peek` return,
        after the cross-rank reduction, to set statistics that are no mean, sum or max of per-rank
        values from parts recorded as sums and maxima (popping the parts: sinks never see them).
        `stabkit.probes.split_exact` uses it under data, tensor and sequence parallelism."""
        self.derivations.setdefault(key, make)

    def defer(self, finish: Callable[[], None]) -> None:
        """Run `finish` (once, however often deferred) before the current step's statistics are next
        read — `current`, `current_names`, `commit` — so that it can record them (`add_vector`)."""
        self._deferred[finish] = None  # bound methods of one object compare equal: deferred once

    def add_packed(
        self,
        names: tuple[str, ...],
        combines: tuple[Combine, ...],
        reductions: tuple[Reduction, ...],
        values: torch.Tensor,
        every: int | None = None,
    ) -> None:
        """Record the statistics `names` at once (traced hooks; no host sync): `values` (k + 1,) holds
        each as its slot keeps it (squared for 'rms') and, last, the count (1 for one measurement).
        `every`: they come from gated ops of that cadence (zeros on other steps: dropped then)."""
        pack = self._packs.get(names)
        if pack is not None:
            values = merge_packed(pack[0], values, combines)
        self._packs[names] = (values, combines, reductions, every)

    def _unpack(self) -> None:
        """Eager: deferred finishing runs, vectors and packs become slots (merged with any slot of the
        same name), reductions registered."""
        while self._deferred:
            finishers, self._deferred = list(self._deferred), {}
            for finish in finishers:
                finish()
        vectors, self._vectors = self._vectors, []
        for names, values, combine, reduction in vectors:
            kept = (values * values if combine == "rms" else values).float()
            repeats = None
            if len(set(names)) < len(names):  # a module called twice, micro-batches finished together
                repeats = self._repeats.get((names, kept.device))
                if repeats is None:
                    repeats = self._repeats[(names, kept.device)] = _Repeats.of(names, kept.device)
                names, kept = repeats.names, repeats.fold(kept, combine)
            if combine != "last" and any(n in self._current or n in self._in_whole for n in names):
                for i, (name, value) in enumerate(zip(names, kept.unbind(), strict=True)):
                    self._merge(name, value, 1 if repeats is None else repeats.counts[i], combine, reduction)
                continue  # merged with what came before
            for name in names:
                self.reductions.setdefault(name, reduction)
                if name in self._in_whole:  # 'last': the newer value replaces the older
                    self._explode(self._in_whole[name])
                self._current.pop(name, None)
            vector = _Vector(names, kept, combine, repeats)
            self._whole[id(vector)] = vector
            self._in_whole.update(dict.fromkeys(names, id(vector)))
        packs, self._packs = self._packs, {}
        gate = self.gate
        for names, (values, combines, reductions, every) in packs.items():
            if every is not None and gate is not None and not gate(every):
                continue  # a gated op's zeros on a step its cadence does not sample
            count = values[-1]
            for i, (name, combine, reduction) in enumerate(zip(names, combines, reductions, strict=True)):
                self._merge(name, values[i], count, combine, reduction)

    def _explode(self, key: int) -> None:
        """A whole vector's names are recorded again: its values become ordinary slots."""
        vector = self._whole.pop(key)
        for i, (name, value) in enumerate(zip(vector.names, vector.stored.unbind(), strict=True)):
            del self._in_whole[name]
            self._current[name] = _Slot(value, vector.count(i), vector.combine)

    def current(self, name: str) -> torch.Tensor | None:
        """The current step's combined value of `name` (device tensor), if recorded."""
        self._unpack()
        key = self._in_whole.get(name)
        if key is not None:
            vector = self._whole[key]
            return vector.finished()[vector.names.index(name)]
        slot = self._current.get(name)
        return None if slot is None else _finish(slot)

    def current_names(self) -> list[str]:
        """Names recorded so far in the current step: the single records in the order first recorded
        (traced packs after the eager records), then those of the vectors (`add_vector`)."""
        self._unpack()
        return [*self._current, *self._in_whole]

    def commit(self, step: int) -> StepValues:
        """Close the current step: its statistics join the pending interval, packed into one 1-d
        tensor per device (one object per step instead of hundreds of 0-d tensors, which cost memory
        between log intervals). Returns the step's values as 0-d device tensors (for the detectors).
        Vectors kept whole are finished and packed as vectors: a few ops, not a few per name."""
        self._unpack()
        values = {name: _finish(slot) for name, slot in self._current.items()}
        vectors = [(v.names, v.finished()) for v in self._whole.values()]
        self._current, self._whole, self._in_whole = {}, {}, {}
        parts: dict[torch.device, tuple[list[str], list[torch.Tensor]]] = {}
        if values:
            for name, t in values.items():
                parts.setdefault(t.device, ([], []))[0].append(name)
        for _, finished in vectors:
            parts.setdefault(finished.device, ([], []))[1].append(finished)
        if parts:
            groups = []
            for device, (scalars, whole) in parts.items():
                names = [*scalars, *(n for ns, f in vectors if f.device == device for n in ns)]
                key = tuple(names)
                key = self._names.setdefault(key, key)  # steps with the same metrics share one tuple
                packed = [torch.stack([values[n] for n in scalars])] if scalars else []
                groups.append((key, packed[0] if not whole else torch.cat([*packed, *whole])))
            self._pending.append((step, groups))
        return StepValues(values, vectors)

    @property
    def pending_steps(self) -> int:
        """Committed steps not yet copied to the host."""
        return len(self._pending)

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """Copy every pending step to the host in one transfer per device; returns (step, values) pairs."""
        if not self._pending:
            return []
        out = self._host_rows(self._pending, self.reducer)
        self._pending = []
        self._names = {}
        self._repeats = {}  # rebuilt once an interval: bounded however the names vary
        return out

    def peek(self, start: int = 0) -> list[tuple[int, dict[str, float]]]:
        """The pending steps from the `start`-th on, copied to the host (one transfer per device) and
        kept pending: `drain` still writes them out. This rank's own values (no cross-rank reduce: that
        is a collective every rank must reach). Runs when a user reads `Monitor.metrics`."""
        # sync point: the caller asked for host values
        return self._host_rows(self._pending[start:], None)

    def _host_rows(
        self, pending: list[tuple[int, list[tuple[tuple[str, ...], torch.Tensor]]]], reducer: Reducer | None
    ) -> list[tuple[int, dict[str, float]]]:
        """(step, values) pairs of `pending` steps: one host copy per device, after `reducer`."""
        if not pending:
            return []
        packs: dict[torch.device, list[torch.Tensor]] = {}
        names: dict[torch.device, list[str]] = {}
        for _, groups in pending:
            for key, packed in groups:
                packs.setdefault(packed.device, []).append(packed)
                names.setdefault(packed.device, []).extend(key)
        host: dict[torch.device, list[float]] = {}
        for dev, parts in packs.items():
            flat = torch.cat(parts)
            if reducer is not None:
                flat = reducer(flat, [self.reductions.get(n, "mean") for n in names[dev]])
            host[dev] = to_host(flat)
        cursor = dict.fromkeys(host, 0)
        out: list[tuple[int, dict[str, float]]] = []
        for step, groups in pending:
            row: dict[str, float] = {}
            for key, packed in groups:
                start = cursor[packed.device]
                row.update(zip(key, host[packed.device][start : start + len(key)]))
                cursor[packed.device] = start + len(key)
            for make in self.derivations.values():
                make(row)
            out.append((step, row))
        return out


class StepValues(Mapping[str, torch.Tensor]):
    """A committed step's values by name (`Recorder.commit`): 0-d device tensors, those of vectors
    indexed out of them only when asked for (the detectors read a few names per step)."""

    def __init__(self, scalars: dict[str, torch.Tensor], vectors: list[tuple[tuple[str, ...], torch.Tensor]]):
        self._scalars = scalars
        self._vectors = vectors
        self._where: dict[str, tuple[int, int]] | None = None

    def _index(self) -> dict[str, tuple[int, int]]:
        if self._where is None:
            self._where = {
                n: (v, i) for v, (names, _) in enumerate(self._vectors) for i, n in enumerate(names)
            }
        return self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self._scalars.get(name)
        if value is not None:
            return value
        v, i = self._index()[name]
        return self._vectors[v][1][i]

    def __contains__(self, name: object) -> bool:
        return name in self._scalars or name in self._index()

    def __iter__(self) -> Iterator[str]:
        yield from self._scalars
        for names, _ in self._vectors:
            yield from names

    def __len__(self) -> int:
        return len(self._scalars) + sum(len(names) for names, _ in self._vectors)


def merge_packed(old: torch.Tensor, new: torch.Tensor, combines: tuple[Combine, ...]) -> torch.Tensor:
    """Two packs of the same statistics (`Recorder.add_packed`) as one: max/min where they combine so,
    the newer for 'last', else (sum, mean, rms as squares, and the count) the sum. Traced: one kernel."""
    kinds = (*combines, "sum")
    flags = torch.tensor(
        [[k == "max" for k in kinds], [k == "min" for k in kinds], [k == "last" for k in kinds]],
        device=old.device,
    )
    summed = torch.where(flags[2], new, old + new)
    return torch.where(
        flags[0], torch.maximum(old, new), torch.where(flags[1], torch.minimum(old, new), summed)
    )


def to_host(values: torch.Tensor) -> list[float]:
    """The one host copy of a log interval (per device)."""
    return values.cpu().tolist()  # sync point: once per log interval


def _finish(slot: _Slot) -> torch.Tensor:
    """The slot's value: a mean, the root of a mean square, or as kept (a division by a count of 1,
    exact, is skipped)."""
    one = isinstance(slot.count, int) and slot.count == 1
    if slot.combine == "mean":
        return slot.value if one else slot.value / slot.count
    if slot.combine == "rms":
        return torch.sqrt(slot.value if one else slot.value / slot.count)
    return slot.value

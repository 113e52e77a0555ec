"""Statistics that stay exact when the batch, the sequence or the heads are split over ranks.

Most statistics combine across ranks by their declared reduction (mean, sum, max): a max logit is the
max of the ranks' maxima. Some do not: the min over heads of a per-head *mean* entropy, the largest
per-head mean first-key mass, the fraction of sink heads, the channel of the largest activation, the
kurtosis of the per-channel RMS — each rank's value is a min, argmax or moment of its own rows only.
Under data parallel (DDP, FSDP2), sequence parallel and tensor parallel (heads split) each probe
records, next to the usual values, their *parts* — per-head sums and counts, per-channel sums of
squares, token counts, per-channel maxima — with reduction sum or max, numbered by global head (a
tensor-parallel rank holds heads ``offset .. offset + local``, zeros elsewhere). After the one
cross-rank reduction of the log interval, `Recorder.derive` divides and takes minima, maxima and
argmaxima on the host, overwriting the per-rank values and dropping the parts.

Only in a job of several ranks (one process records no parts: its values are exact as they are).
The parts are recorded in the probes' eager finishing work (`Recorder.defer`), on sampled steps;
their derivation runs once per logged row. Compiled models keep the per-rank values (not derived).
Within one step the parts of several micro-batches add up, so a derived value is that of all of the
step's measured rows together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from ..attention.measure.stats import HeadStats
from ..metric_names import metric
from ..stats.outliers import TINY
from ..stats.recorder import Recorder

Derivation = Callable[[dict[str, float]], None]
"""Sets derived statistics in a host row from their reduced parts, popping the parts."""

PARTS = "parts"
"""Metric family of the parts (never written: the derivation pops them)."""


def head_offset(model: nn.Module, q_path: str | None, heads: int, local: int) -> int | None:
    """The global index of this rank's first query head when its attention computes `local` of
    `heads` heads: 0 when it computes all; under tensor parallel, from the placement of the query
    projection's weight (rows sharded by ``Shard(0)`` on tensor-parallel mesh dims; FSDP2's
    ``_StridedShard`` dim is gathered before the forward). None when it cannot be told."""
    if local == heads:
        return 0
    if q_path is None or local <= 0 or heads % local:
        return None
    weight = getattr(model.get_submodule(q_path), "weight", None)
    placements = getattr(weight, "placements", None)
    if weight is None or placements is None:
        return None
    mesh = weight.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    index, shards = 0, 1
    for dim, placement in enumerate(placements):
        if type(placement).__name__ == "Shard" and placement.dim == 0:
            index = index * mesh.size(dim) + coordinate[dim]
            shards *= mesh.size(dim)
    if shards * local != heads:
        return None
    return index * local


def record_head_parts(
    recorder: Recorder,
    calls: Sequence[tuple[str, HeadStats]],
    heads: dict[str, tuple[int, int]],
    per_head: bool,
    head_max: torch.Tensor,
) -> None:
    """Record the per-head parts of measured calls of one layout (the attention probe's `_record`):
    `heads` path -> (global heads, this rank's first head); `head_max` (C, h) per-head max logits as
    the probe reports them. Calls of a path without an entry in `heads` record nothing."""
    kept = [(i, path) for i, (path, _) in enumerate(calls) if path in heads]
    if not kept:
        return
    stats = HeadStats.stacked([s for _, s in calls])
    local = stats.rows.shape[-1]
    parts: dict[str, tuple[torch.Tensor, Literal["sum", "max"]]] = {
        "entropy_sum": (stats.entropy_sum, "sum"),
        "rows": (stats.rows, "sum"),
        "first_sum": (
            stats.first_sum if stats.first_sum is not None else torch.zeros_like(stats.rows),
            "sum",
        ),
    }
    if stats.sink_sum is not None:
        parts["sink_sum"] = (stats.sink_sum, "sum")
    if per_head:
        parts["max_logit"] = (head_max, "max")
    for part, (value, reduction) in parts.items():
        pieces, names = [], []
        for i, path in kept:
            count, offset = heads[path]
            full = value.new_zeros(count)
            full[offset : offset + local] = value[i]
            pieces.append(full)
            names += [metric(PARTS, path, f"head.{g}/{part}") for g in range(count)]
        recorder.add_vector(tuple(names), torch.cat(pieces), combine=reduction, reduction=reduction)
    for _, path in kept:
        recorder.derive(
            f"attn:{path}",
            _attention_derivation(path, heads[path][0], stats.sink_sum is not None, per_head),
        )


def _attention_derivation(path: str, heads: int, sinks: bool, per_head: bool) -> Derivation:
    def part(name: str) -> list[str]:
        return [metric(PARTS, path, f"head.{g}/{name}") for g in range(heads)]

    names = {p: part(p) for p in ("entropy_sum", "rows", "first_sum", "sink_sum", "max_logit")}

    def derive(row: dict[str, float]) -> None:
        if names["rows"][0] not in row:
            return  # not measured in this step
        got = {
            p: torch.tensor([row.pop(n) for n in ns], dtype=torch.float64)
            for p, ns in names.items()
            if ns[0] in row
        }
        # float64 on the host, with the device summaries' own ops (NaN propagates as there)
        sums = HeadStats(
            got.get("max_logit", torch.zeros(heads, dtype=torch.float64)),
            got["entropy_sum"],
            got["rows"],
            got["first_sum"],
            got.get("sink_sum"),
        )
        ratio, top = sums.attention_sinks()
        out = {
            "entropy": sums.entropy(),
            "min_head_entropy": sums.min_head_entropy(),
            "sink_heads": ratio,
            "first_key_mass": top,
        }
        sink = sums.sink_mass()
        if sink is not None:
            out["sink_mass"] = sink.mean()
        if per_head:
            head_entropy, first = sums.head_entropy(), sums.first_key_mass()
            for g in range(heads):
                out[f"head.{g}/max_logit"] = sums.max_logit[g]
                out[f"head.{g}/entropy"] = head_entropy[g]
                out[f"head.{g}/first_key_mass"] = first[g]
                if sink is not None:
                    out[f"head.{g}/sink_mass"] = sink[g]
        for stat, value in out.items():
            row[metric("attn", path, stat)] = float(value)

    return derive


def record_channel_parts(recorder: Recorder, path: str, x: torch.Tensor) -> None:
    """Record the per-channel parts of a block output `x` (..., D) (the outlier probe's hook):
    sums of squares and maxima of |x| per channel, and the token count."""
    flat = x.detach().reshape(-1, x.shape[-1])
    mag = flat.abs().float()
    d = flat.shape[-1]
    sumsq = (mag * mag).sum(dim=0)
    top = mag.amax(dim=0)
    tokens = torch.full((1,), float(flat.shape[0]), device=flat.device)
    square_names = tuple(metric(PARTS, path, f"channel.{c}/sumsq") for c in range(d))
    top_names = tuple(metric(PARTS, path, f"channel.{c}/top") for c in range(d))
    recorder.add_vector(
        (*square_names, metric(PARTS, path, "tokens")), torch.cat([sumsq, tokens]), "sum", "sum"
    )
    recorder.add_vector(top_names, top, "max", "max")
    recorder.derive(f"act:{path}", _channel_derivation(path, square_names, top_names))


def _channel_derivation(path: str, squares: tuple[str, ...], tops: tuple[str, ...]) -> Derivation:
    count = metric(PARTS, path, "tokens")

    def derive(row: dict[str, float]) -> None:
        if count not in row:
            return
        tokens = max(row.pop(count), 1.0)
        sumsq = torch.tensor([row.pop(n) for n in squares], dtype=torch.float64)
        top = torch.tensor([row.pop(n) for n in tops], dtype=torch.float64)
        rms = (sumsq / tokens).sqrt()  # as `stats.outliers`, in float64 (NaN propagates)
        centred = rms - rms.mean()
        var, fourth = centred.pow(2).mean(), centred.pow(4).mean()
        kurtosis = torch.where(var > 0, fourth / var.clamp_min(TINY).pow(2) - 3.0, 0.0)
        row[metric("act", path, "kurtosis")] = float(kurtosis)
        row[metric("act", path, "massive_dim")] = float(top.argmax())

    return derive

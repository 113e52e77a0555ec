"""Cross-rank reduction of statistics, and one agreed flag for decisions.

`reduce_stacked` is the Recorder's reducer: `Recorder.drain` calls it once per log interval
with every pending value of this rank stacked into one 1-d tensor, each entry tagged with its
declared reduction. It runs ONE collective:

- all_gather of the (N,) vector into (world, N), then each entry is combined on every rank by
  its reduction (mean, sum, max, min, l2 = √Σx², rms = √mean x²). Exact for every reduction, NaN
  and ±Inf propagate (torch's amax/amin propagate NaN; NCCL's MAX need not), and every rank gets
  bitwise the same result. It moves world × N values, fine up to `GATHER_LIMIT` elements.
- above that (thousands of ranks × many metrics) it switches to one all_reduce SUM (sums, means,
  squares for l2/rms, and a NaN count for max/min entries) plus one all_reduce MAX (max, and min
  as a max of negatives): two collectives, N values each, independent of the world size.

Every rank must call these at the same point with the same number of entries (same model,
same MonitorConfig): a length/layout fingerprint travels with the values; on a mismatch each rank
warns and keeps its own values for that interval (training goes on).

`agree(flag)` and `reduce_now(values, reductions)` are for per-step decisions (detectors), and
`first_across_ranks` for a rare host-side finding all ranks must report alike: call them on every
rank, at the same point of the step.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from .context import local, process_group_active

CODES = {"mean": 0, "sum": 1, "max": 2, "min": 3, "l2": 4, "rms": 5}
"""Reductions a metric may declare."""
GATHER_LIMIT = 1 << 22
"""Above world × values elements (16 MiB of float32), use SUM + MAX instead of one all_gather."""
HEADER = 2
"""Entries prepended to each payload: length and layout fingerprint."""

_warned_gone = False
T = TypeVar("T")


class ReductionMismatchError(RuntimeError):
    """Ranks sent different metric layouts to one reduction (they recorded different statistics)."""


def codes_of(reductions: Sequence[str], device: torch.device) -> torch.Tensor:
    """(N,) int64 codes of the declared reductions; an unknown name raises with the allowed ones."""
    try:
        return torch.tensor([CODES[r] for r in reductions], dtype=torch.int64, device=device)
    except KeyError as exc:
        raise ValueError(f"unknown cross-rank reduction {exc.args[0]!r}; allowed: {sorted(CODES)}") from None


def fingerprint(reductions: Sequence[str]) -> float:
    """A 20-bit hash of the layout (exact in float32), equal on ranks that recorded alike."""
    return float(zlib.crc32("".join(str(CODES.get(r, 9)) for r in reductions).encode()) & 0xFFFFF)


def combine(table: torch.Tensor, reductions: Sequence[str]) -> torch.Tensor:
    """(world, N) per-rank values -> (N,) combined by each column's reduction (no communication)."""
    table = table.float()
    codes = codes_of(reductions, table.device)
    world = table.shape[0]
    total = table.sum(0)
    squares = table.square().sum(0)
    out = torch.where(codes == CODES["sum"], total, total / world)
    out = torch.where(codes == CODES["max"], table.amax(0), out)
    out = torch.where(codes == CODES["min"], table.amin(0), out)
    out = torch.where(codes == CODES["l2"], squares.sqrt(), out)
    return torch.where(codes == CODES["rms"], (squares / world).sqrt(), out)


def collective_device(t: torch.Tensor) -> torch.device:
    """Where the default backend can reduce `t`: CUDA for NCCL, the CPU for gloo, else t's device."""
    backend = str(dist.get_backend())
    if t.device.type == "cpu" and backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if t.device.type != "cpu" and backend == "gloo":
        return torch.device("cpu")
    return t.device


def _header(values: torch.Tensor, reductions: Sequence[str]) -> torch.Tensor:
    return torch.tensor([float(values.numel()), fingerprint(reductions)], device=values.device)


def _gather(x: torch.Tensor, reductions: Sequence[str], world: int) -> torch.Tensor:
    payload = torch.cat([_header(x, reductions), x])
    flat = torch.empty(world * payload.numel(), device=x.device)
    _all_gather(flat, payload)  # the one collective of this interval
    table = flat.view(world, payload.numel())
    if not bool((table[:, :HEADER] == payload[:HEADER]).all()):  # sync point (the host copy follows anyway)
        raise ReductionMismatchError(_mismatch(table[:, 0].tolist()))
    return combine(table[:, HEADER:], reductions)


def _all_gather(out: torch.Tensor, payload: torch.Tensor) -> None:
    """Gather every rank's `payload` into the flat `out` (all_gather_single from torch 2.11 on)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, payload)


def _sum_and_max(x: torch.Tensor, reductions: Sequence[str], world: int) -> torch.Tensor:
    codes = codes_of(reductions, x.device)
    extreme = (codes == CODES["max"]) | (codes == CODES["min"])
    squared = (codes == CODES["l2"]) | (codes == CODES["rms"])
    nan = torch.isnan(x)
    summed = torch.where(extreme, nan.float(), torch.where(squared, x.square(), x))
    summed = torch.cat([_header(x, reductions), summed])
    signed = torch.where(codes == CODES["min"], -x, x).masked_fill(nan, -torch.inf)
    signed = torch.where(extreme, signed, torch.full_like(x, -torch.inf))
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(signed, op=dist.ReduceOp.MAX)
    if not bool((summed[:HEADER] == _header(x, reductions) * world).all()):  # sync point
        raise ReductionMismatchError(_mismatch([summed[0].item() / world]))
    s = summed[HEADER:]
    out = torch.where(codes == CODES["sum"], s, s / world)
    out = torch.where(codes == CODES["l2"], s.sqrt(), out)
    out = torch.where(codes == CODES["rms"], (s / world).sqrt(), out)
    peak = torch.where(codes == CODES["min"], -signed, signed)
    peak = torch.where(s > 0, torch.full_like(peak, torch.nan), peak)  # some rank had NaN
    return torch.where(extreme, peak, out)


def _mismatch(lengths: list[float]) -> str:
    return (
        f"stabkit: ranks recorded different statistics in one log interval (value counts {lengths}), "
        "so this interval keeps each rank's own values; every rank must attach stabkit with the same "
        "model and MonitorConfig and call Monitor.step the same number of times"
    )


def reduce_stacked(
    values: torch.Tensor, reductions: Sequence[str], gather_limit: int = GATHER_LIMIT
) -> torch.Tensor:
    """Combine this rank's (N,) values with every other rank's, entry by entry (see module notes).

    The Recorder's reducer: runs in `Recorder.drain`, once per log interval, on every rank. Returns
    `values` unchanged when collectives are off (also when the process group is already gone,
    with a warning: the values are then this rank's own).
    """
    if len(reductions) != values.numel():
        raise ValueError(f"{values.numel()} values but {len(reductions)} reductions")
    if not process_group_active():
        _warn_gone()
        return values
    world = dist.get_world_size()
    dev = collective_device(values)
    x = values.detach().reshape(-1).to(dev, torch.float32)
    try:
        if world * (x.numel() + HEADER) <= gather_limit:
            out = _gather(x, reductions, world)
        else:
            out = _sum_and_max(x, reductions, world)
    except ReductionMismatchError as exc:
        warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
        return values
    return out.to(values.device, values.dtype)


def reduce_now(values: torch.Tensor, reductions: Sequence[str]) -> torch.Tensor:
    """Per-step version of `reduce_stacked` for decisions (identity when not distributed).

    Call on every rank at the same point of the step, with the same number of values."""
    if not process_group_active():
        return values
    return reduce_stacked(values, reductions)


def host_values(tensors: Sequence[torch.Tensor], reductions: Sequence[str]) -> list[float]:
    """0-d device tensors -> host floats, each combined across ranks by its reduction first.

    For per-step decisions (detectors): one stack, at most one collective (none when not
    distributed), one host copy. Flags use "max" (true on some rank = true everywhere); metrics
    their declared reduction (`Recorder.reductions`). Call on every rank at the same point.
    """
    if not tensors:
        return []
    first = tensors[0]
    # the common case, every step: 0-d values of one dtype and device, no collective -> one stack, one copy
    plain = type(first) is torch.Tensor and not process_group_active()
    if plain:
        dtype, where = first.dtype, first.device
        for t in tensors:
            if (
                type(t) is not torch.Tensor
                or t.dim()
                or t.dtype != dtype
                or t.device != where
                or t.requires_grad
            ):
                plain = False
                break
    if plain:
        return [float(v) for v in torch.stack(list(tensors)).tolist()]  # sync point
    device = local(first).device
    # a DTensor flag: this rank's value (combined below); 0-d float32 values on one device as they are
    stacked = torch.stack(
        [
            t.detach()
            if type(t) is torch.Tensor and t.dtype == torch.float32 and t.dim() == 0 and t.device == device
            else local(t).detach().float().reshape(()).to(device)
            for t in tensors
        ]
    )
    return reduce_now(stacked, reductions).tolist()  # sync point


def first_across_ranks(item: T | None, order: float = 0.0) -> T | None:
    """The `item` of the rank with the smallest `order` (ties: the lowest rank); None when no rank
    has one. Identity when not distributed.

    For rare host-side findings every rank must report alike (where a NaN was made): one
    `all_gather_object` of picklable items. Call on every rank at the same point (a collective),
    also on ranks that found nothing (`item` None)."""
    if not process_group_active():
        return item
    gathered: list[tuple[float, T] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if item is None else (float(order), item))  # sync point
    found = [g for g in gathered if g is not None]
    return min(found, key=lambda g: g[0])[1] if found else None  # min keeps the first of equals


def agree(flag: torch.Tensor) -> torch.Tensor:
    """True on every rank when `flag` is true (or NaN) on some rank: one all_reduce MAX.

    Identity when not distributed. Same shape, dtype and device as `flag`; no host sync (the
    caller reads it). Call on every rank at the same point of the step (it is a collective).
    """
    if not process_group_active():
        return flag
    dev = collective_device(flag)
    x = flag.detach().to(dev, torch.float32).nan_to_num(nan=1.0)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    agreed = x > 0 if flag.dtype == torch.bool else x
    return agreed.to(flag.device, flag.dtype)


def _warn_gone() -> None:
    global _warned_gone
    if dist.is_available() and not dist.is_initialized() and not _warned_gone:
        _warned_gone = True
        warnings.warn(
            "stabkit: the process group was destroyed before the monitor flushed; the last statistics "
            "are this rank's own (detach the monitor before dist.destroy_process_group())",
            RuntimeWarning,
            stacklevel=3,
        )

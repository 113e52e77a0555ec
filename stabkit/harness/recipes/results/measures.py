"""The numbers a variant is judged by, beside its held-out loss (`stabkit.harness.training.evaluate`,
in the run's precision): a bigram reference, smoothed and tail losses, and aggregates of the
monitored series.

Called in the worker process once a variant has ended, and by `stabkit report` on a log.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

import torch

from ...data import load_corpus


@lru_cache(maxsize=4)
def bigram_loss(data: Any) -> float:
    """Held-out loss (nats/token) of a bigram model counted on the training split (add-0.1 smoothing):
    the level at or above which a run counts as diverged. 2.317 on the embedded text. A vocabulary
    beyond bytes (a synthetic language, `data` a `SyntheticSpec`) is counted sparsely."""
    corpus = load_corpus(data)
    train, val = corpus.train, corpus.val
    vocab = int(getattr(corpus, "vocab", 256))
    if vocab > 256:
        return _sparse_bigram_loss(train, val, vocab)
    counts = torch.zeros(256, 256, dtype=torch.float64)
    counts.index_put_(
        (train[:-1], train[1:]), torch.ones(len(train) - 1, dtype=torch.float64), accumulate=True
    )
    probs = (counts + 0.1) / (counts + 0.1).sum(1, keepdim=True)
    return float(-probs[val[:-1], val[1:]].log().mean())


def _sparse_bigram_loss(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """`bigram_loss` for a large vocabulary: pair counts by `torch.unique` (no V × V table)."""
    pairs, counts = torch.unique(train[:-1] * vocab + train[1:], return_counts=True)
    rows = torch.bincount(train[:-1], minlength=vocab).double()
    want = val[:-1] * vocab + val[1:]
    at = torch.searchsorted(pairs, want).clamp_max(len(pairs) - 1)
    hit = torch.where(pairs[at] == want, counts[at].double(), 0.0)
    probs = (hit + 0.1) / (rows[val[:-1]] + 0.1 * vocab)
    return float(-probs.log().mean())


def best_smoothed(losses: list[float]) -> float:
    """Lowest moving average of `losses` (window 5 % of the run, at least 1); NaN windows skipped."""
    if not losses:
        return math.nan
    w = max(1, len(losses) // 20)
    # One pass with a running sum (the windows overlap: summing each one anew is O(n·w), minutes
    # for a 100k-step log); the sum is recomputed every w steps so rounding cannot drift, and the
    # chosen window's mean is taken exactly as sum(window) / w.
    run, bad, best, start = 0.0, 0, math.inf, -1
    for i, v in enumerate(losses):
        if i >= w:
            gone = losses[i - w]
            bad -= not math.isfinite(gone)
            if i % w == 0:
                run = sum(x for x in losses[i - w + 1 : i] if math.isfinite(x))
            elif math.isfinite(gone):
                run -= gone
        if math.isfinite(v):
            run += v
        else:
            bad += 1
        if i >= w - 1 and not bad and run < best:
            best, start = run, i - w + 1
    return sum(losses[start : start + w]) / w if start >= 0 else math.nan


def tail_mean(losses: list[float]) -> float:
    """Mean of the last 10 % of `losses` (NaN when any of them is not finite)."""
    if not losses:
        return math.nan
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail)


def aggregate(history: Iterable[tuple[int, dict[str, float]]], pattern: str, agg: str) -> tuple[float, str]:
    """`agg` (max, min, mean, first, last) of every logged value whose name matches `pattern`, and
    the name that gave a max / min. NaN when nothing matched. Non-finite values count for max/min."""
    values: list[tuple[int, str, float]] = []
    matches: dict[str, bool] = {}  # the same few hundred names repeat on every row
    for step, row in history:
        for name, value in row.items():
            hit = matches.get(name)
            if hit is None:
                hit = matches[name] = fnmatch.fnmatchcase(name, pattern)
            if hit:
                values.append((step, name, value))
    if not values:
        return math.nan, ""
    if agg == "first":
        return values[0][2], values[0][1]
    if agg == "last":
        return values[-1][2], values[-1][1]
    if agg == "mean":
        finite = [v for _, _, v in values if math.isfinite(v)]
        return (sum(finite) / len(finite) if finite else math.nan), ""
    key = (
        (lambda t: t[2] if not math.isnan(t[2]) else -math.inf)
        if agg == "max"
        else (lambda t: t[2] if not math.isnan(t[2]) else math.inf)
    )
    chosen = max(values, key=key) if agg == "max" else min(values, key=key)
    return chosen[2], chosen[1]


def monitored(history: list[tuple[int, dict[str, float]]]) -> dict[str, Any]:
    """The table's monitored quantities: max attention logit (before and after any cap, and where),
    max log Z."""
    top, where = aggregate(history, "attn/*/max_logit", "max")
    capped, _ = aggregate(history, "attn/*/max_logit_capped", "max")
    logz, _ = aggregate(history, "logits/logz_max", "max")
    return {
        "max_attn_logit": top,
        "max_attn_logit_at": where.removeprefix("attn/").removesuffix("/max_logit"),
        "max_attn_logit_capped": capped,
        "max_logz": logz,
    }

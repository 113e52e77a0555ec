"""What each column of the results table means (the legend printed under it), and which columns a
monitored run's own log leaves out.

Used by `report.results_table` and the `stabkit report` / `stabkit run` output. A "log" summary (a
user's monitored run, read from its ``stabkit.jsonl``) has no held-out batches, bigram level or
verdict: those columns would read ``-`` (and "logged") on every row, so they are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

MEANINGS: dict[str, str] = {
    "variant": "the recipe's variant, or the run's folder (a logdir's later runs: run-2, ...)",
    "final": "training loss, mean of the last 10 % of logged steps",
    "best": "training loss, lowest moving average (window: 5 % of the logged steps)",
    "val": "held-out loss after training",
    "max attn logit": "largest pre-softmax attention logit logged (attn/*/max_logit), before any cap",
    "max logZ": "largest log Z of the output logits logged (logits/logz_max)",
    "mean|logZ|": "mean |log Z| on the held-out batches after training",
    "mean logit": "mean output logit on the held-out batches after training",
    "MaxVio": "mixture of experts: (max - mean)/mean tokens per expert of the worst layer, last 10 % of the run (0 balanced; E/k - 1: every token on the same k experts)",
    "dead experts": "mixture of experts: the most experts one layer had without a token over the last 100 steps, at the end",
    "first event": "kind@step of the first event the detectors reported",
    "above bigram": "whether the held-out loss ended non-finite or no better than a bigram model's",
    "verdict": "what the recipe's checks concluded for the variant",
}
"""Column header -> one line on what it shows (a header not listed here is shown without one)."""

EMPTY = ("-", "", "logged")
"""Cells that say nothing: a column of a "log" summary whose every cell is one of these is left out."""


def shown(
    headers: Sequence[str], rows: Sequence[Sequence[str]], kind: str
) -> tuple[list[str], list[list[str]]]:
    """`headers` and `rows` without the columns that say nothing on any row, for a "log" summary (a
    monitored run's own log); every column for a recipe or sweep. The first column always stays."""
    keep = [
        i
        for i in range(len(headers))
        if i == 0 or kind != "log" or not rows or any(r[i] not in EMPTY for r in rows)
    ]
    return [headers[i] for i in keep], [[r[i] for i in keep] for r in rows]


def legend(headers: Sequence[str]) -> str:
    """ "columns:", then one indented line per column shown (after the first) that `MEANINGS` explains:
    ``  final  training loss, mean of ...``."""
    known = [h for h in headers[1:] if h in MEANINGS]
    width = max((len(h) for h in known), default=0)
    return "\n".join(["columns:", *(f"  {h.ljust(width)}  {MEANINGS[h]}" for h in known)])

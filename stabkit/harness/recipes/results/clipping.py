"""What the clipping fixes of a run did, from its monitor's history: ``qk_clip`` (fraction of heads
clipped over time, when clipping went quiet, how far past τ a head got after its first clip) and the
adaptive-clipping action ``clip`` (how many steps it clipped).

Called by `stabkit.harness.recipes.results.finish` once a variant has ended; the numbers join the
variant's summary entry (`CLIP_KEYS`), where checks and the report read them by name.
"""

from __future__ import annotations

import math
from typing import Any

CLIP_KEYS = (
    "qk_clip_heads_fraction",
    "qk_clip_fraction_curve",
    "qk_clip_share_curve",
    "qk_clip_first_step",
    "qk_clip_quiet_step",
    "qk_clip_steps",
    "qk_clip_max_after_clip",
    "clip_steps",
    "clip_first_step",
)
"""The keys `clip_quantities` may return, in order."""

CURVE_AT = (0.1, 0.25, 0.5, 0.75, 1.0)
"""Fractions of the run at which the fraction of heads clipped so far is reported."""
SHARE_PARTS = 6
"""The run is cut into this many equal parts for the mean share of heads clipped per step."""


def clip_quantities(history: list[tuple[int, dict[str, float]]], steps: int) -> dict[str, Any] | None:
    """From the logged rows (every step): with ``qk_clip``, the fraction of heads clipped at least
    once (``qk_clip_heads_fraction``; ``qk_clip_fraction_curve``: ``[step, fraction]`` at `CURVE_AT`
    of the run; ``qk_clip_share_curve``: ``[first step, mean share of heads clipped per step]`` in
    each sixth of the run), the first and the last step with a clip (the clip went quiet after
    ``qk_clip_quiet_step``), the steps with a clip, and the largest max logit of a head after its
    first clip (``qk_clip_max_after_clip``: τ(1+ε) bounds it when the clip holds the logits); with
    the action ``clip``, the steps it clipped and the first. None when neither ran."""
    out: dict[str, Any] = {}
    clipped = [(s, r["qk_clip/heads_clipped"]) for s, r in history if "qk_clip/heads_clipped" in r]
    if clipped:
        shares = [(s, r["qk_clip/share_clipped"]) for s, r in history if "qk_clip/share_clipped" in r]
        ever = [(s, r["qk_clip/ever_clipped"]) for s, r in history if "qk_clip/ever_clipped" in r]
        active = [s for s, n in clipped if n > 0]
        after = [
            r["qk_clip/max_logit_clipped_heads"] for _, r in history if "qk_clip/max_logit_clipped_heads" in r
        ]
        curve = []
        for frac in CURVE_AT:
            at = max(0, math.ceil(frac * steps) - 1)
            seen = [v for s, v in ever if s <= at]
            curve.append([at, seen[-1] if seen else 0.0])
        share = []
        size = max(1, math.ceil(steps / SHARE_PARTS))
        for start in range(0, max(steps, 1), size):
            part = [v for s, v in shares if start <= s < start + size]
            share.append([start, sum(part) / len(part) if part else 0.0])
        out.update(
            qk_clip_heads_fraction=ever[-1][1] if ever else 0.0,
            qk_clip_fraction_curve=curve,
            qk_clip_share_curve=share,
            qk_clip_first_step=active[0] if active else None,
            qk_clip_quiet_step=active[-1] if active else None,
            qk_clip_steps=len(active),
            qk_clip_max_after_clip=max(after) if after else 0.0,
        )
    did = [s for s, r in history if r.get("clip/did_clip", 0.0) > 0]
    if any("clip/did_clip" in r for _, r in history):
        out.update(clip_steps=len(did), clip_first_step=did[0] if did else None)
    return out or None

"""Draw docs/tensorboard.png: the TensorBoard scalars of a `stabkit run attention-logit-growth` output.

Run from the repository root after a run (``stabkit run attention-logit-growth --out runs/alg``):

    python docs/tensorboard_figure.py runs/alg docs/tensorboard.png

It reads the event files with TensorBoard's own reader and draws four of the charts a user opens first
— loss, the largest attention logit, the lowest head entropy (both of the first block) and log Z —
one line per variant, with the steps where the baseline's events fired. (A drawing of the charts, not a
browser screenshot: these machines have no browser; the numbers are the event files'.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

CHARTS = [
    ("loss", "loss", False),
    ("attn/blocks.0.attn/max_logit", "attn/blocks.0.attn/max_logit", True),
    ("attn/blocks.0.attn/min_head_entropy", "attn/blocks.0.attn/min_head_entropy (nats)", False),
    ("logits/logz_mean", "logits/logz_mean", False),
]
VARIANTS = ["baseline", "qk_norm", "qk_clip", "rescue", "reference"]
COLORS = {
    "baseline": "#d62728",
    "qk_norm": "#2ca02c",
    "qk_clip": "#9467bd",
    "rescue": "#ff7f0e",
    "reference": "#1f77b4",
}


def scalars(folder: Path) -> dict[str, tuple[list[int], list[float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        out[tag] = ([e.step for e in events], [e.value for e in events])
    return out


def main(run: Path, target: Path) -> None:
    data = {v: scalars(run / v) for v in VARIANTS if (run / v).is_dir()}
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), dpi=110)
    fig.patch.set_facecolor("#f5f5f5")
    for ax, (tag, title, log) in zip(axes.flat, CHARTS):
        for name, tags in data.items():
            if tag in tags:
                steps, values = tags[tag]
                ax.plot(steps, values, label=name, color=COLORS.get(name), linewidth=1.4)
        for kind, style in (("events/attn_entropy", ":"), ("events/drift", "--")):
            steps, values = data.get("baseline", {}).get(kind, ([], []))
            for s, v in zip(steps, values):
                if v > 0:
                    ax.axvline(s, color="#d62728", linestyle=style, linewidth=0.8, alpha=0.7)
        ax.set_title(title, fontsize=9, loc="left")
        ax.set_yscale("log" if log else "linear")
        ax.grid(True, color="#dddddd", linewidth=0.6)
        ax.tick_params(labelsize=8)
    axes.flat[0].legend(fontsize=8, frameon=False)
    fig.suptitle(
        "TensorBoard scalars of stabkit run attention-logit-growth (tiny, seed 0); "
        "red lines: the baseline's events (dotted entropy collapse, dashed drift)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(target)
    print(target)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))

"""The training loop the distributed tests run, on one process (the reference) or on each rank.

Every rank takes its rows of the same global batch, so DDP / FSDP2 on N ranks computes the same
gradients as one process on the whole batch. Gradients are clipped to a small norm, so the test
also checks that the logged norms are the ones *before* clipping, as in a single process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root

from zoo import batch, lm_loss, reference_gpt  # noqa: E402

import stabkit  # noqa: E402

GLOBAL_BATCH = 4
STEPS = 4
CLIP = 0.5
CONFIG = dict(every=1, log_every=3, console=False, audit=False)


MOE = dict(n_experts=4, top_k=2)
"""The mixture-of-experts variant of the reference GPT (the 'ddp_moe' scenario)."""


def make_model(moe: bool = False) -> nn.Module:
    """The tiny reference GPT (with `moe`, its MLPs a top-2 of 4 mixture), the same weights on every
    process."""
    torch.manual_seed(0)
    return reference_gpt(**MOE) if moe else reference_gpt()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    monitor: stabkit.Monitor,
    rows: slice,
    steps: int = STEPS,
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Train `steps` steps on rows `rows` of each global batch; returns this process's losses."""
    losses = []
    for step in range(steps):
        x, y = batch(step, bsz=GLOBAL_BATCH)
        loss = lm_loss(model(x[rows]), y[rows])
        loss.backward()
        if before_step is not None:
            before_step(step)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        monitor.step(loss)
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def single_process_rows(logdir: str, moe: bool = False, **overrides: object) -> dict[int, dict[str, float]]:
    """Run the reference on one process (whole batch) and return its logged rows by step."""
    model = make_model(moe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = stabkit.MonitorConfig(**{**CONFIG, **overrides})  # type: ignore[arg-type]
    mon = stabkit.attach(model, opt, logdir=logdir, config=config)
    with mon:
        train(model, opt, mon, slice(0, GLOBAL_BATCH))
    return {step: values for step, values in mon.history}

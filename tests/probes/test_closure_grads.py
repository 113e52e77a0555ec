"""Gradients made inside ``optimizer.step(closure)`` (LBFGS-style loops, Lightning's every step) are
counted: stabkit's gradient norms equal the norm computed by hand from the parameters' ``.grad``
after the closure ran, with and without gradient accumulation, for one optimizer, several, and
LBFGS (the first closure evaluation: the gradient at the parameters the step started from); and the
training is the same bit for bit with the monitor on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit

STEPS = 4
CONFIG = dict(every=1, log_every=1000, console=False, audit=False)


def true_norm(params: list[nn.Parameter]) -> float:
    """‖g‖ of every gradient present, by torch's own routine."""
    return float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))


def series(mon: stabkit.Monitor, name: str) -> dict[int, float]:
    """step -> value of one metric from the monitor's history."""
    return {step: values[name] for step, values in mon.history if name in values}


def train(
    make_opt: Callable[[nn.Module], Any], accumulate: int, monitored: bool, lbfgs: bool = False
) -> tuple[nn.Module, list[float], list[float], stabkit.Monitor | None]:
    """`STEPS` steps of ``opt.step(closure)``; the first ``accumulate - 1`` micro-batches of a step
    run their backward before ``step``, the last one inside the closure. Returns the model, the
    true norm of each step (read after ``step`` returned; LBFGS: at the closure's first call), the
    norm of blocks.1's gradients, and the monitor."""
    torch.manual_seed(0)
    model = reference_gpt()
    opts = make_opt(model)
    opts = opts if isinstance(opts, list) else [opts]
    params = list(model.parameters())
    block = [p for n, p in model.named_parameters() if n.startswith("blocks.1.")]
    mon = stabkit.attach(model, opts, config=stabkit.MonitorConfig(**CONFIG)) if monitored else None  # type: ignore[arg-type]
    norms, block_norms = [], []
    for step in range(STEPS):
        for opt in opts:
            opt.zero_grad()
        for micro in range(accumulate - 1):
            x, y = batch(100 * step + micro)
            (lm_loss(model(x), y) / accumulate).backward()
        x, y = batch(100 * step + accumulate - 1)
        calls: list[tuple[float, float]] = []

        def closure(x: torch.Tensor = x, y: torch.Tensor = y, calls: list = calls) -> torch.Tensor:
            if lbfgs:  # re-evaluated at trial points: a fresh gradient each call
                opts[0].zero_grad()
            loss = lm_loss(model(x), y) / accumulate
            loss.backward()
            if not calls:
                calls.append((true_norm(params), true_norm(block)))
            return loss

        loss = opts[0].step(closure)
        for opt in opts[1:]:
            opt.step()
        first, first_block = calls[0]
        norms.append(first if lbfgs else true_norm(params))
        block_norms.append(first_block if lbfgs else true_norm(block))
        if mon is not None:
            mon.step(loss)
    if mon is not None:
        mon.detach()
    return model, norms, block_norms, mon


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def two(model: nn.Module) -> list[torch.optim.Optimizer]:
    """AdamW for the blocks, SGD for the rest: `attach` sees them as one OptimizerSet."""
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    return [torch.optim.AdamW(blocks, lr=1e-3), torch.optim.SGD(rest, lr=1e-2)]


def lbfgs(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)


CASES = {
    "adamw": (adamw, 1, False),
    "adamw-accumulate-3": (adamw, 3, False),
    "two-optimizers-accumulate-2": (two, 2, False),
    "lbfgs": (lbfgs, 1, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_closure_gradients_are_counted_with_their_true_norm(case: str) -> None:
    make_opt, accumulate, is_lbfgs = CASES[case]
    _, norms, block_norms, mon = train(make_opt, accumulate, monitored=True, lbfgs=is_lbfgs)
    assert mon is not None
    got = series(mon, "grad/global_norm")
    assert sorted(got) == list(range(STEPS))  # every step has its norm
    assert [got[s] for s in range(STEPS)] == pytest.approx(norms, rel=1e-5)
    blocks = series(mon, "grad/blocks.1/norm")
    assert [blocks[s] for s in range(STEPS)] == pytest.approx(block_norms, rel=1e-5)
    # the update after the closure is seen too (a ratio needs the snapshot taken before the update)
    assert sorted(series(mon, "update/global_ratio")) == list(range(STEPS))


@pytest.mark.parametrize("case", list(CASES))
def test_monitoring_a_closure_changes_no_bit_of_training(case: str) -> None:
    make_opt, accumulate, is_lbfgs = CASES[case]
    bare, bare_norms, _, _ = train(make_opt, accumulate, monitored=False, lbfgs=is_lbfgs)
    watched, norms, _, _ = train(make_opt, accumulate, monitored=True, lbfgs=is_lbfgs)
    assert norms == bare_norms
    for (name, a), b in zip(bare.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_lbfgs_norm_is_the_first_evaluation_not_a_line_search_point() -> None:
    """LBFGS evaluates the closure several times per step; the step's gradient is the first one's."""
    evaluations: list[float] = []
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(**CONFIG))  # type: ignore[arg-type]
    x, y = batch(0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        evaluations.append(true_norm(list(model.parameters())))
        return loss

    mon.step(opt.step(closure))
    mon.detach()
    assert len(evaluations) > 1 and evaluations[-1] != pytest.approx(evaluations[0], rel=1e-3)
    assert series(mon, "grad/global_norm")[0] == pytest.approx(evaluations[0], rel=1e-5)


def clipped_run(in_closure: bool) -> tuple[nn.Module, dict[int, dict[str, float]]]:
    """8 steps of 2 micro-batches with ZClip on (an outlier batch at step 6): the second backward
    runs inside ``opt.step(closure)`` or before a plain ``opt.step()``."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detect = stabkit.DetectConfig(
        detectors=("spike",), actions={"spike": ["warn", "clip"]}, options={"clip": {"warmup": 3}}
    )
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(**CONFIG, detect=detect))  # type: ignore[arg-type]
    for step in range(8):
        scale = 50.0 if step == 6 else 1.0

        def micro(i: int, step: int = step, scale: float = scale) -> torch.Tensor:
            x, y = batch(100 * step + i)
            loss = scale * lm_loss(model(x), y) / 2
            loss.backward()
            return loss

        opt.zero_grad()
        first = micro(0)
        if in_closure:
            second = opt.step(lambda: micro(1))
        else:
            second = micro(1)
            opt.step()
        mon.step(first.detach() + second.detach())
    mon.detach()
    return model, dict(mon.history)


def test_a_closure_loop_and_a_plain_loop_are_the_same_to_stabkit() -> None:
    """Everything stabkit does in its step pre-hooks — the gradient norms and ZClip, which scales the
    gradients there — sees the closure's gradients as it sees a plain loop's: the same statistics,
    the same clip at the outlier, the same parameters bit for bit."""
    plain, plain_rows = clipped_run(in_closure=False)
    closure, closure_rows = clipped_run(in_closure=True)
    assert plain_rows[6]["clip/did_clip"] == 1.0  # the outlier was clipped
    for name in ("grad/global_norm", "clip/pre_norm", "clip/post_norm", "clip/did_clip"):
        assert [closure_rows[s][name] for s in range(8)] == [plain_rows[s][name] for s in range(8)], name
    for (name, a), b in zip(plain.named_parameters(), closure.parameters(), strict=True):
        assert torch.equal(a, b), name

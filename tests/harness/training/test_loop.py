"""The training loop owns precision: `TrainConfig.precision` is autocast around the forward pass and
the loss (and evaluation), fp16 a GradScaler where one is used; `train` takes a `TrainRun` and
`Callbacks`, and returns the losses."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stabkit.harness.data import load_corpus
from stabkit.harness.models import GPT, GPTConfig
from stabkit.harness.training import Amp, Callbacks, TrainConfig, TrainRun, evaluate, train

CFG = GPTConfig(d_model=32, n_layers=1, n_heads=2, context=16)


def tiny_run(precision: str = "fp32", steps: int = 3, **overrides: Any) -> TrainRun:
    torch.manual_seed(0)
    settings: dict[str, Any] = {"batch_size": 4, "warmup": 1, **overrides}
    config = TrainConfig(steps=steps, precision=precision, **settings)  # type: ignore[arg-type]
    return TrainRun(GPT(CFG), load_corpus(), config, CFG.context)


def test_amp_of_each_precision() -> None:
    assert Amp.of("fp32", "cpu").scaler is None and Amp.of("fp32", "cpu").dtype == torch.float32
    assert Amp.of("bf16", "cpu").dtype == torch.bfloat16 and Amp.of("bf16", "cpu").scaler is None
    fp16 = Amp.of("fp16", "cpu")
    assert fp16.dtype == torch.float16
    assert fp16.scaler is None  # on a CPU fp16 is autocast without loss scaling (module docstring)
    scaled = Amp.of("fp16", "cpu", scaler=True)
    assert isinstance(scaled.scaler, torch.amp.GradScaler) and scaled.scaler.is_enabled()
    assert Amp.of("bf16", "cpu", scaler=True).scaler is None  # only fp16 is scaled
    assert tiny_run("fp16").amp.scaler is None  # TrainConfig.grad_scaler None: the device decides
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        Amp.of("fp8", "cpu")  # type: ignore[arg-type]


def test_forward_and_loss_run_under_autocast_and_nothing_else_does() -> None:
    run = tiny_run("bf16", steps=2)
    seen: list[tuple[bool, torch.dtype]] = []

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen.append((torch.is_autocast_enabled("cpu"), output.dtype))

    run.model.head.register_forward_hook(hook)  # type: ignore[union-attr]
    outside: list[bool] = []
    result = train(run, Callbacks(after_update=lambda loss: outside.append(torch.is_autocast_enabled("cpu"))))
    assert seen == [(True, torch.bfloat16)] * 2  # the logits come out of the head in bf16
    assert outside == [False, False]  # the optimizer step and the monitor's step run in fp32
    assert len(result.losses) == 2 and not torch.is_autocast_enabled("cpu")
    before = len(seen)
    heldout = evaluate(run.model, run.corpus, batches=1, batch_size=2, context=CFG.context, amp=run.amp)
    assert seen[before:] == [(True, torch.bfloat16)]  # evaluation: the same precision
    assert heldout.val_loss > 0 and run.model.training


def test_fp16_with_a_scaler_skips_an_overflowing_step_and_without_one_the_weights_break() -> None:
    def trained(scaled: bool) -> tuple[TrainRun, list[float]]:
        run = tiny_run("fp16", steps=4, grad_scaler=scaled)  # TrainConfig.grad_scaler: on a CPU too
        assert (run.amp.scaler is not None) == scaled
        step = {"n": 0}

        def poison(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
            if module.training and step["n"] == 1:
                return output * float("inf")  # one step overflows fp16 in the forward pass
            return None

        run.model.blocks[0].mlp.register_forward_hook(poison)  # type: ignore[index, union-attr]

        def on_step(i: int, loss: float) -> None:
            step["n"] = i + 1

        return run, train(run, Callbacks(on_step=on_step)).losses

    run, losses = trained(scaled=True)
    assert run.amp.scaler is not None and run.amp.scaler.get_scale() < 2.0**16  # backed off once
    assert not torch.isfinite(torch.tensor(losses[1]))
    assert all(torch.isfinite(p).all() for p in run.model.parameters())  # the update was skipped
    assert all(torch.isfinite(torch.tensor(v)) for v in losses[2:])  # and training went on
    run, losses = trained(scaled=False)
    assert not all(torch.isfinite(p).all() for p in run.model.parameters())  # what the recipes show


def test_on_end_runs_when_the_loop_raises_and_the_lr_follows_the_schedule() -> None:
    run = tiny_run(steps=5, lr=0.01, warmup=2)
    ended, lrs = [], []

    def on_step(step: int, loss: float) -> None:
        lrs.append(run.optimizer.param_groups[0]["lr"])
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(run, Callbacks(on_step=on_step, on_end=lambda: ended.append(True)))
    assert ended == [True]
    assert lrs[:2] == pytest.approx([0.005, 0.01])  # linear warmup over 2 steps


def test_the_same_seed_trains_the_same_losses() -> None:
    assert train(tiny_run()).losses == train(tiny_run()).losses

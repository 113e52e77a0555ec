"""Bad input gets a clear error; odd-but-valid input (frozen, tied parameters) just works;
a failing probe warns once and steps aside unless strict."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.interventions import InterventionError
from stabkit.probes import ProbeError


def one_step(
    model: nn.Module, mon: stabkit.Monitor, opt: torch.optim.Optimizer | None = None
) -> torch.Tensor:
    x, y = batch(0)
    loss = lm_loss(model(x), y)
    loss.backward()
    if opt is not None:
        opt.step()
    mon.step(loss)
    return loss


def test_non_module_and_bad_config() -> None:
    with pytest.raises(TypeError, match=r"expects a torch\.nn\.Module, got dict"):
        stabkit.attach({"w": torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a stabkit.MonitorConfig"):
        stabkit.attach(reference_gpt(), config={"every": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        stabkit.attach(reference_gpt(), "adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="log_every must be an integer >= 1"):
        stabkit.MonitorConfig(log_every=-5)
    with pytest.raises(ValueError, match="attn_sample_rows must be None"):
        stabkit.MonitorConfig(attn_sample_rows=0)
    with pytest.raises(ValueError, match="modules must be None, a glob string"):
        stabkit.MonitorConfig(modules=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="matches no module"):
        stabkit.attach(reference_gpt(), config=stabkit.MonitorConfig(modules=["nothing.*"]))


def test_model_without_attention_is_monitored_and_the_gap_said_once() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    mon = stabkit.attach(mlp, config=stabkit.MonitorConfig(console=False, every=1, log_every=1))
    with pytest.warns(RuntimeWarning, match=r"no attention call stabkit can read.*register_kernel") as said:
        out = mlp(torch.randn(2, 4))  # discovery traces this first forward: it must not stop it
    assert len([w for w in said if "stabkit" in str(w.message)]) == 1
    out.pow(2).mean().backward()
    mon.step(out.pow(2).mean())
    assert "loss" in mon.metrics and mon.model_map.logits is not None  # the rest is monitored
    mon.detach()
    tokens = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))  # an input stabkit can make: at attach
    with pytest.warns(RuntimeWarning, match=r"no attention call stabkit can read"):
        stabkit.attach(tokens, config=stabkit.MonitorConfig(console=False)).detach()
    with pytest.raises(stabkit.DiscoveryError, match=r"no attention call.*strict mode"):
        stabkit.attach(tokens, config=stabkit.MonitorConfig(console=False, strict=True))


def test_optimizer_with_foreign_parameters() -> None:
    model = reference_gpt()
    extra = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    with pytest.raises(ValueError, match=r"holds 1 parameter\(s\) that are not in the model"):
        stabkit.attach(model, opt)


def test_an_empty_batch_runs_unmeasured_with_one_warning_and_every_probe_kept() -> None:
    """An empty batch is the data loader's bug, not a reason for stabkit to stop the run: the forward
    runs as without stabkit, its statistics are not taken (no empty reductions, no probe disabled by
    one), the first such forward is told once, and the next batch is measured as usual."""
    torch.manual_seed(0)
    model = reference_gpt()
    bare = reference_gpt()
    bare.load_state_dict(model.state_dict())
    empty = torch.zeros(0, 16, dtype=torch.long)
    mon = stabkit.attach(model, config=stabkit.MonitorConfig(console=False, every=1, log_every=1))
    x, _ = batch(0)
    mon.step(model(x).sum())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = model(empty)
        mon.step(out.sum())  # 0: a row for the step, with the loss
        mon.step(model(empty).sum())  # a second one: not told again
    told = [str(w.message) for w in said if "empty batch" in str(w.message)]
    assert len(told) == 1 and "input of shape (0, 16)" in told[0] and "drop_last" in told[0]
    assert torch.equal(out, bare(empty)) and out.shape == (0, 16, 64)
    mon.step(model(x).sum())
    mon.flush()
    rows = dict(mon.history)
    measured = [n for n in rows[0] if n.split("/")[0] in ("act", "attn", "logits")]
    assert len(measured) > 10
    for step in (1, 2):  # the empty forwards: none of the forward statistics
        assert not [n for n in rows[step] if n.split("/")[0] in ("act", "attn", "logits")]
    assert set(measured) <= set(rows[3]) and all(math.isfinite(rows[3][n]) for n in measured)
    assert all(p.enabled for p in mon.probes)
    mon.detach()


def test_frozen_parameters_are_left_out_and_tied_ones_counted_once() -> None:
    torch.manual_seed(0)
    model = reference_gpt(tie_embeddings=True)
    model.blocks[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, console=False))
    x, y = batch(0)
    loss = lm_loss(model(x), y)
    loss.backward()
    grads = [
        p.grad for p in model.parameters() if p.grad is not None
    ]  # parameters() yields the tied one once
    expected = torch.cat([g.flatten() for g in grads]).norm().item()
    opt.step()
    mon.step(loss)
    mon.flush()
    assert mon.metrics["grad/global_norm"] == pytest.approx(expected, rel=1e-5)
    assert "grad/blocks.0/norm" not in mon.metrics and "grad/blocks.1/norm" in mon.metrics
    assert mon.metrics["grad/tok_emb/norm"] == pytest.approx(
        model.tok_emb.weight.grad.norm().item(), rel=1e-5
    )
    assert "grad/head/norm" not in mon.metrics  # the head's weight is the embedding
    mon.detach()


def test_intervention_that_cannot_apply_names_intervention_module_and_missing_piece() -> None:
    class NoNormAttn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.mlp = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(x + self.attn(x, x, x, need_weights=False)[0])

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(NoNormAttn() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    x = torch.randn(2, 5, 8)  # float inputs: discovery and the interventions wait for the first forward
    for spec, message in [
        (["rmsnorm"], r"rmsnorm: cannot apply to Tiny: no nn\.LayerNorm found"),
        (["z_loss"], r"z_loss: cannot apply to Tiny: no final logits found.*\(pass model_map"),
        (
            [("norm_placement", {"to": "post"})],
            r"norm_placement: cannot apply to layers\.0: .*residual wiring",
        ),
    ]:
        model = Tiny()
        stabkit.attach(model, interventions=spec)
        with pytest.raises(InterventionError, match=message):
            model(x)
        assert not model._forward_pre_hooks  # nothing stays attached


class OddOutput(nn.Module):
    """Returns an object stabkit cannot read a tensor from."""

    def forward(self, x: torch.Tensor) -> Any:
        return {"shape": tuple(x.shape)}


def model_with_odd_module() -> nn.Module:
    model = reference_gpt()
    model.blocks[0].attn.add_module("odd", OddOutput())
    original = model.blocks[0].attn.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        model.blocks[0].attn.odd(x)
        return original(x)

    model.blocks[0].attn.forward = forward  # type: ignore[method-assign]
    return model


def test_failing_probe_warns_once_disables_itself_and_training_goes_on() -> None:
    model = model_with_odd_module()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = stabkit.MonitorConfig(every=1, modules=["blocks.0.attn.odd", "blocks.1"], console=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = stabkit.attach(model, opt, config=cfg)
        for _ in range(3):
            one_step(model, mon, opt)
            opt.zero_grad()
    mine = [w for w in caught if "probe 'act' failed" in str(w.message)]
    assert len(mine) == 1 and "holds no tensor" in str(mine[0].message)
    mon.flush()
    assert "grad/global_norm" in mon.metrics and "loss" in mon.metrics  # other probes carry on
    mon.detach()


def test_strict_raises_instead() -> None:
    model = model_with_odd_module()
    cfg = stabkit.MonitorConfig(every=1, modules=["blocks.0.attn.odd"], console=False, strict=True)
    with stabkit.attach(model, config=cfg), pytest.raises(ProbeError, match="holds no tensor"):
        model(batch(0)[0])

"""What real training scripts do: several optimizers, unfreezing, compile before attach, Adam with
decoupled decay, fp16 with a broken weight, detach/re-attach with interventions, bad inputs."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.detectors import DetectConfig

QUIET = {"console": False, "audit": False}


def _grad_norm(params: list[nn.Parameter]) -> float:
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params if p.grad is not None))


def test_two_optimizers_every_parameter_in_the_norm_and_one_step_hook() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    emb = [model.tok_emb.weight, model.pos_emb.weight]
    rest = [p for p in model.parameters() if all(p is not e for e in emb)]
    opt_emb, opt_rest = torch.optim.SGD(emb, lr=0.1), torch.optim.AdamW(rest, lr=1e-3)
    mon = stabkit.attach(
        model, [opt_emb, opt_rest], config=stabkit.MonitorConfig(every=1, log_every=1, **QUIET)
    )
    idx, tgt = batch(0)
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    want = _grad_norm(list(model.parameters()))
    old = [p.detach().clone() for p in model.parameters()]
    opt_emb.step()
    opt_rest.step()
    mon.step(loss)
    assert mon.metrics["grad/global_norm"] == pytest.approx(want, rel=1e-5)
    delta = math.sqrt(sum(float((p.detach() - o).pow(2).sum()) for p, o in zip(model.parameters(), old)))
    norm = math.sqrt(sum(float(o.pow(2).sum()) for o in old))
    assert mon.metrics["update/global_ratio"] == pytest.approx(delta / norm, rel=1e-4)
    mon.detach()
    assert not opt_emb._optimizer_step_pre_hooks and not opt_rest._optimizer_step_post_hooks


def test_skip_stops_every_optimizer() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    emb = [model.tok_emb.weight]
    rest = [p for p in model.parameters() if p is not model.tok_emb.weight]
    opts = [torch.optim.SGD(emb, lr=0.1), torch.optim.AdamW(rest, lr=1e-3)]
    cfg = stabkit.MonitorConfig(detect=DetectConfig(actions={"nonfinite": "skip"}), **QUIET)
    mon = stabkit.attach(model, opts, config=cfg)
    idx, tgt = batch(0)
    loss = lm_loss(model(idx), tgt) * float("nan")
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    for opt in opts:
        opt.step()
    mon.step(loss)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert [e.kind for e in mon.events] == ["nonfinite"]
    mon.detach()


def test_trainable_parameters_outside_the_optimizers_are_named() -> None:
    model = reference_gpt()
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("tok_emb")], lr=0.1)
    with pytest.warns(
        RuntimeWarning, match=r"1 trainable parameter\(s\) are in no optimizer.*tok_emb.weight"
    ):
        stabkit.attach(model, opt, config=stabkit.MonitorConfig(**QUIET)).detach()


def test_unfrozen_parameters_and_a_new_group_are_followed() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, log_every=1, **QUIET))
    for step in range(2):
        if step == 1:  # gradual unfreezing: block 0 joins, in its own group
            for p in model.blocks[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model.blocks[0].parameters())})
        idx, tgt = batch(step)
        loss = lm_loss(model(idx), tgt)
        loss.backward()
        want = _grad_norm([p for p in model.parameters() if p.requires_grad])
        opt.step()
        mon.step(loss)
        assert mon.metrics["grad/global_norm"] == pytest.approx(want, rel=1e-5)
        opt.zero_grad()
    assert "grad/blocks.0/norm" in mon.metrics and "grad/param_group.1/norm" in mon.metrics
    mon.detach()


def test_adam_with_decoupled_weight_decay_update_ratio() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, log_every=1, **QUIET))
    for step in range(2):
        idx, tgt = batch(step)
        loss = lm_loss(model(idx), tgt)
        loss.backward()
        old = [p.detach().clone() for p in model.parameters()]
        opt.step()
        mon.step(loss)
        opt.zero_grad()
    delta = math.sqrt(sum(float((p.detach() - o).pow(2).sum()) for p, o in zip(model.parameters(), old)))
    norm = math.sqrt(sum(float(o.pow(2).sum()) for o in old))
    assert mon.metrics["update/global_ratio"] == pytest.approx(delta / norm, rel=1e-4)
    mon.detach()


def _fp16_step_with_a_nan_weight(detect: DetectConfig | None) -> stabkit.Monitor:
    """One GradScaler step of a model whose blocks.1.mlp.fc weight holds a NaN."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    mon = stabkit.attach(model, opt, scaler=scaler, config=stabkit.MonitorConfig(detect=detect, **QUIET))
    with torch.no_grad():
        model.blocks[1].mlp.fc.weight[0, 0] = float("nan")
    idx, tgt = batch(0)
    loss = lm_loss(model(idx), tgt)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    mon.step(loss)
    return mon


def test_fp16_scaler_with_a_nan_weight_is_reported_as_the_weight() -> None:
    mon = _fp16_step_with_a_nan_weight(DetectConfig())
    events = [e for e in mon.events if e.kind in ("nonfinite", "amp")]
    assert len(events) == 1 and events[0].kind == "nonfinite"
    assert events[0].where == "blocks.1.mlp.fc"  # the weight, not "the scaler doing its job"
    assert "scaler doing its job" not in events[0].message
    mon.detach()


def test_fp16_scaler_with_a_nan_weight_and_no_detectors_still_names_it() -> None:
    mon = _fp16_step_with_a_nan_weight(None)
    assert [(e.kind, e.where) for e in mon.events] == [("nonfinite", "blocks.1.mlp.fc")]
    assert "not because the loss scale is too high" in mon.events[0].message
    mon.detach()


def test_detach_leaves_the_optimizer_as_it_found_it_and_attach_works_again() -> None:
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = len(opt.param_groups)
    for _ in range(2):
        mon = stabkit.attach(model, opt, interventions=["qk_norm"], config=stabkit.MonitorConfig(**QUIET))
        assert len(opt.param_groups) == groups + 1
        idx, tgt = batch(0)
        lm_loss(model(idx), tgt).backward()
        opt.step()
        mon.step()
        opt.zero_grad()
        mon.detach()
        assert len(opt.param_groups) == groups
        assert all(any(p is q for g in opt.param_groups for q in g["params"]) for p in opt.state)


def test_bad_config_values_and_a_per_token_loss_are_refused() -> None:
    with pytest.raises(ValueError, match="attn_every must be None or an integer"):
        stabkit.MonitorConfig(attn_every=True)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="options.rollback.snapshot_device: .*must be None or a torch device"
    ):
        DetectConfig(options={"rollback": {"snapshot_device": "tpu:0"}})
    with pytest.raises(ValueError, match="matches no module"):
        stabkit.attach(reference_gpt(), config=stabkit.MonitorConfig(modules="nothing.*", **QUIET))
    model = reference_gpt()
    mon = stabkit.attach(model, config=stabkit.MonitorConfig(**QUIET))
    idx, tgt = batch(0)
    per_token = nn.functional.cross_entropy(model(idx).flatten(0, 1), tgt.flatten(), reduction="none")
    with pytest.raises(ValueError, match=r"pass a scalar loss \(e\.g\. loss\.mean\(\)\)"):
        mon.step(per_token)
    mon.detach()


def test_compiled_and_trained_before_attach_still_gets_forward_statistics() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    compiled = torch.compile(model)
    idx, tgt = batch(0)
    lm_loss(compiled(idx), tgt).backward()  # compiled and run before stabkit is attached
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.warns(RuntimeWarning, match="torch.compile had compiled code"):
            mon = stabkit.attach(compiled, config=stabkit.MonitorConfig(every=1, log_every=1, **QUIET))
        loss = lm_loss(compiled(idx), tgt)
        loss.backward()
        mon.step(loss)
    assert any(k.startswith("act/blocks.0") for k in mon.metrics)
    assert any(k.startswith("attn/blocks.0.attn") for k in mon.metrics)
    mon.detach()


def test_attach_again_after_detach_resets_nothing_and_says_nothing_unless_something_compiled() -> None:
    """Detach drops the code compiled with its hooks; a second attach with no compile in between has
    nothing to drop, so it does not warn (Dynamo's counters survive a reset: the count is compared
    with the one at stabkit's last reset). A compile in between is reset again, and said."""
    torch.manual_seed(0)
    model = reference_gpt()
    compiled = torch.compile(model, backend="eager")
    idx, tgt = batch(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = stabkit.attach(compiled, config=stabkit.MonitorConfig(**QUIET))
        loss = lm_loss(compiled(idx), tgt)  # compiled while attached
        loss.backward()
        mon.step(loss)
        mon.detach()  # resets what was compiled with its hooks
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        again = stabkit.attach(compiled, config=stabkit.MonitorConfig(**QUIET))
    assert [str(w.message) for w in said if "compiled code" in str(w.message)] == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = lm_loss(compiled(idx), tgt)  # compiled again, now with the second monitor's hooks
        loss.backward()
        again.step(loss)
    assert any(k.startswith("act/blocks.0") for k in again.metrics)
    again.detach()
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))  # something new compiled
    with pytest.warns(RuntimeWarning, match="torch.compile had compiled code"):
        stabkit.attach(reference_gpt(), config=stabkit.MonitorConfig(**QUIET)).detach()

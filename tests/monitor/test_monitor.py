"""attach() on every family writes readable TensorBoard files, observes only, and detaches cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from zoo import FAMILIES, batch, forward_logits, lm_loss, reference_gpt

import stabkit
from stabkit.sinks import LOG_NAME, read_jsonl


def train(
    model: nn.Module,
    steps: int,
    monitor_cfg: stabkit.MonitorConfig | None,
    logdir: Path | None,
    attach: bool = True,
) -> tuple[list[float], stabkit.Monitor | None]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mon = stabkit.attach(model, opt, logdir=logdir, config=monitor_cfg) if attach else None
    losses = []
    for s in range(steps):
        x, y = batch(s)
        loss = lm_loss(forward_logits(model, x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if mon is not None:
            mon.step(loss)
        opt.zero_grad()
        losses.append(loss.item())
    if mon is not None:
        mon.detach()
    return losses, mon


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_twenty_steps_write_tags_for_every_block(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]()
    cfg = stabkit.MonitorConfig(every=5, log_every=10, console=False)
    _, mon = train(model, 20, cfg, tmp_path)
    assert mon is not None
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    blocks = mon.model_map.block_paths
    assert len(blocks) == 2
    for b in blocks:
        assert f"act/{b}/rms" in tags and f"act/{b}/absmax" in tags and f"act/{b}/nonfinite" in tags
        assert f"grad/{b}/norm" in tags
        assert f"update/{b}/ratio" in tags
        assert f"param/{b}/norm" in tags
    assert {
        "logits/max_abs",
        "logits/logz_mean",
        "logits/logz_max",
        "logits/mean",
        "grad/global_norm",
        "loss",
    } <= tags
    # every step has the cheap scalars; per-layer ones only on sampled steps (0, 5, 10, 15)
    assert [e.step for e in acc.Scalars("loss")] == list(range(20))
    assert [e.step for e in acc.Scalars(f"act/{blocks[0]}/rms")] == [0, 5, 10, 15]
    rows = [r for r in read_jsonl(tmp_path / LOG_NAME) if r["type"] == "metrics"]
    assert [r["step"] for r in rows] == list(range(20))
    assert rows[5]["values"][f"grad/{blocks[1]}/norm"] > 0


@pytest.mark.parametrize("family", ["reference", "hf_llama", "encoder"])
def test_observation_only_bitwise(family: str) -> None:
    def run(attach: bool) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(1)
        model = FAMILIES[family]() if family != "reference" else reference_gpt(dropout=0.1)
        losses, _ = train(model, 20, stabkit.MonitorConfig.full(console=False), None, attach=attach)
        return losses, [p.detach().clone() for p in model.parameters()], torch.rand(3)

    base_losses, base_params, base_rng = run(False)
    mon_losses, mon_params, mon_rng = run(True)
    assert base_losses == mon_losses
    assert all(torch.equal(a, b) for a, b in zip(base_params, mon_params))
    assert torch.equal(base_rng, mon_rng), "the global RNG stream must not change"


def hook_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[object]:
    state: list[object] = []
    for m in model.modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_hooks_always_called",
            "_forward_pre_hooks_with_kwargs",
        ):
            state.append(dict(getattr(m, attr)))
    for p in model.parameters():
        state.append(dict(p._post_accumulate_grad_hooks or {}))
        state.append(dict(p._backward_hooks or {}))
    state.append(dict(opt._optimizer_step_pre_hooks))
    state.append(dict(opt._optimizer_step_post_hooks))
    return state


def test_detach_removes_every_hook_and_is_idempotent(tmp_path: Path) -> None:
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters())
    before = hook_state(model, opt)
    mon = stabkit.attach(model, opt, logdir=tmp_path, config=stabkit.MonitorConfig.full(console=False))
    assert hook_state(model, opt) != before
    mon.detach()
    assert hook_state(model, opt) == before
    mon.detach()  # second call is a no-op
    with pytest.raises(RuntimeError, match="after detach"):
        mon.step(1.0)


def test_context_manager_flushes_when_the_loop_raises(tmp_path: Path) -> None:
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = stabkit.MonitorConfig(every=1, log_every=1000, console=False)
    with (
        pytest.raises(RuntimeError, match="boom"),
        stabkit.attach(model, opt, logdir=tmp_path, config=cfg) as mon,
    ):
        for s in range(3):
            x, y = batch(s)
            lm_loss(model(x), y).backward()
            opt.step()
            mon.step(torch.tensor(float(s)))
            opt.zero_grad()
        raise RuntimeError("boom")
    rows = [r for r in read_jsonl(tmp_path / LOG_NAME) if r["type"] == "metrics"]
    assert [r["values"]["loss"] for r in rows] == [0.0, 1.0, 2.0]


def test_no_optimizer_takes_grad_stats_at_step() -> None:
    model = reference_gpt()
    mon = stabkit.attach(model, config=stabkit.MonitorConfig(every=1, console=False))
    x, y = batch(0)
    lm_loss(model(x), y).backward()
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    mon.step()
    mon.flush()
    assert mon.metrics["grad/global_norm"] == pytest.approx(expected.item(), rel=1e-5)
    assert not any(k.startswith("update/") for k in mon.metrics)
    mon.detach()


def test_families_switch_statistics_off() -> None:
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = stabkit.MonitorConfig(every=1, families=frozenset({"loss", "logits"}), console=False, detect=None)
    with stabkit.attach(model, opt, config=cfg) as mon:
        x, y = batch(0)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        mon.step(loss)
        mon.flush()
        assert {k.split("/")[0] for k in mon.metrics} == {"loss", "logits"}


def test_bad_inputs_raise_actionable_errors() -> None:
    model = reference_gpt()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        stabkit.attach("model")  # type: ignore[arg-type]
    other = torch.optim.SGD(reference_gpt().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in the model"):
        stabkit.attach(model, other)
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        stabkit.MonitorConfig(every=0)
    with pytest.raises(ValueError, match="unknown name"):
        stabkit.MonitorConfig(families=frozenset({"acts"}))
    mlp = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    strict = stabkit.MonitorConfig(strict=True, console=False)
    stabkit.attach(mlp, config=strict)  # no input stabkit can make: discovery traces the first forward
    with pytest.raises(stabkit.DiscoveryError, match="no attention call.*strict mode"):
        mlp(torch.randn(2, 4))  # strict mode, chosen by the user: the gap stops the run
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks  # nothing stays attached


def test_attach_writes_the_audit_once(tmp_path: Path) -> None:
    model = reference_gpt(norm_placement="post")
    with stabkit.attach(model, logdir=tmp_path, config=stabkit.MonitorConfig(console=False)) as mon:
        assert mon.audit_report is not None
        rules = {f.rule for f in mon.audit_report.findings}
        assert "post_norm" in rules and "attn_softmax_unguarded" in rules
    records = [r for r in read_jsonl(tmp_path / LOG_NAME) if r["type"] == "audit"]
    assert len(records) == 1 and any(f["rule"] == "post_norm" for f in records[0]["findings"])
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    assert "stabkit/audit/text_summary" in acc.Tags()["tensors"]
    off = stabkit.attach(model, config=stabkit.MonitorConfig(console=False, audit=False))
    assert off.audit_report is None
    off.detach()

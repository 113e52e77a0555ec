"""The attention probe measures a forward's plain q/k calls back to back when the forward ends
(`AttentionProbe._defer`), and where they are made otherwise.

Expectations independent of the deferral: the same run with deferral off (``DEFER_BYTES = 0``) gives
bit-identical statistics; *where* each measurement ran is seen by a patched `measure` that reads a
flag the model's own last module (its head) sets in its forward. The faults: an in-place change of
k after the call (the deferred measurement would read other numbers), activation checkpointing
(saved-tensor hooks: q and k do not outlive the block), a byte budget too small for one call.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.probes import attention as attention_probe

CFG = stabkit.MonitorConfig(every=2, log_every=4, console=False, audit=False, detect=None)


class Where:
    """Records, for each `measure` call, whether the model's head had already run in this forward."""

    def __init__(self, model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
        self.head_ran = False
        self.calls: list[bool] = []
        model.head.register_forward_hook(lambda *_: setattr(self, "head_ran", True))
        inner = attention_probe.measure

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(self.head_ran)
            return inner(*args, **kwargs)

        monkeypatch.setattr(attention_probe, "measure", spy)

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.head_ran = False
        return model(x)


def train(
    model: nn.Module, where: Where | None, steps: int = 4, forward: Any = None
) -> dict[str, list[float]]:
    """`steps` monitored steps; the attention metrics of every logged row."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(model, opt, config=CFG)
    for i in range(steps):
        x, y = batch(i)
        logits = (forward or (where.forward if where else None) or (lambda m, t: m(t)))(model, x)
        loss = lm_loss(logits, y)
        loss.backward()
        opt.step()
        mon.step(loss)
        opt.zero_grad(set_to_none=True)
    mon.detach()
    out: dict[str, list[float]] = {}
    for _, row in mon.history:
        for name, value in row.items():
            if name.startswith("attn/"):
                out.setdefault(name, []).append(value)
    return out


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return reference_gpt(n_layers=3)


def test_a_forward_s_calls_are_measured_after_it_with_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = fresh()
    where = Where(model, monkeypatch)
    deferred = train(model, where)
    assert where.calls == [True] * 6  # 3 attention calls on each of 2 sampled steps, all after the head
    monkeypatch.setattr(attention_probe, "DEFER_BYTES", 0)
    model = fresh()
    where = Where(model, monkeypatch)
    now = train(model, where)
    assert where.calls == [False] * 6  # measured where each call is made
    assert now.keys() == deferred.keys() and any(k.endswith("/max_logit") for k in now)
    for name, values in now.items():  # bit for bit
        assert deferred[name] == values, name


def test_a_key_changed_in_place_after_the_call_is_not_read_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward scales block 1's k in place after its attention call (a training forward that is
    not backpropagated: autograd would refuse a backward through a changed saved tensor): the kept
    call's version changed, so it is dropped and that module is measured where its calls are made
    from then on; the other modules stay deferred."""
    model = fresh()
    original = F.scaled_dot_product_attention
    changed = [True]

    def then_change_k(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
        out = original(q, k, v, **kw)
        if changed[0]:
            with torch.no_grad():
                k.mul_(1.0)  # the same values, a new version
        return out

    forward = model.blocks[1].attn.forward

    def patched(*args: Any, **kwargs: Any) -> Any:
        with monkeypatch.context() as m:
            m.setattr(F, "scaled_dot_product_attention", then_change_k)
            return forward(*args, **kwargs)

    model.blocks[1].attn.forward = patched  # type: ignore[method-assign]
    where = Where(model, monkeypatch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(model, opt, config=CFG)
    for i in range(4):
        x, y = batch(i)
        changed[0] = i == 0
        loss = lm_loss(where.forward(model, x), y)
        if i > 0:  # step 0 changed k: no backward through it
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        mon.step(loss)
    mon.detach()
    # step 0: blocks 0 and 2 measured at the end (block 1's kept call dropped); step 2: block 1 at once
    assert where.calls == [True, True, False, True, True]
    rows = [row for _, row in mon.history]
    assert "attn/blocks.1.attn/max_logit" not in rows[0] and "attn/blocks.0.attn/max_logit" in rows[0]
    assert "attn/blocks.1.attn/max_logit" in rows[2]


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant", "outside", "frozen-qk"])
def test_calls_whose_inputs_do_not_outlive_the_block_are_measured_where_they_are_made(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Under activation checkpointing q and k do not outlive their block's forward (saved-tensor
    hooks; the reentrant kind runs it without gradients), blocks called outside the model's forward
    have no forward end to wait for, and a q and k that need no gradient may not be kept by the
    backward: nothing is kept."""
    model = fresh()
    where = Where(model, monkeypatch)

    def forward(m: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        x = m.drop(m.tok_emb(idx) + m.pos_emb(torch.arange(idx.shape[1])))
        for block in m.blocks:
            x = block(x) if mode == "outside" else checkpoint(block, x, use_reentrant=mode == "reentrant")
        return m.head(m.final_norm(x))

    if mode == "frozen-qk":  # q and k need no gradient: the backward need not keep them
        original = F.scaled_dot_product_attention
        monkeypatch.setattr(
            F, "scaled_dot_product_attention", lambda q, k, v, **kw: original(q.detach(), k.detach(), v, **kw)
        )
        values = train(model, where)
    elif mode == "outside":
        values = train(
            model, None, forward=lambda m, idx: (setattr(where, "head_ran", False), forward(m, idx))[1]
        )
    else:
        model.forward = types.MethodType(forward, model)  # the root's hooks run: a forward in progress
        values = train(model, where)
    assert where.calls == [False] * 6
    assert len(values["attn/blocks.2.attn/entropy"]) == 2


def test_calls_past_the_byte_budget_are_measured_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = fresh()
    q_and_k = 2 * 4 * 4 * 16 * 8 * 4  # float32 (batch 4, 4 heads, 16 positions, head dim 8), q and k
    monkeypatch.setattr(attention_probe, "DEFER_BYTES", 2 * q_and_k)  # room for two calls of three
    where = Where(model, monkeypatch)
    train(model, where)
    assert where.calls == [False, True, True] * 2  # the third call at once, the first two at the end

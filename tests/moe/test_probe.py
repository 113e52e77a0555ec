"""The MoE probe's numbers against the model's own routing: tokens per expert equal a hand count of the
indices the router returned, the router statistics equal a materialised computation, a planted dead
expert is counted, attaching changes no bit of training and the hook makes no host sync."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import stabkit
from stabkit.discovery.trace import tracing
from stabkit.moe import probe as probe_mod

from .tiny import build, tokens

QUIET = {"console": False, "audit": False, "detect": None}


def own_routing(model: nn.Module) -> tuple[dict[str, list[tuple[Any, ...]]], list[Any]]:
    """Forward hooks (the test's own) keeping each router's output as the model returned it."""
    seen: dict[str, list[tuple[Any, ...]]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mmap = stabkit.inspect_model(model, example=tokens())
    handles = []
    for moe in mmap.moe:

        def keep(m: nn.Module, a: Any, out: Any, path: str = moe.path) -> None:
            if tracing():  # discovery's traced forward at attach is no training step
                return
            seen.setdefault(path, []).append(tuple(o.detach().clone() for o in out))

        handles.append(model.get_submodule(moe.router).register_forward_hook(keep))
    return seen, handles


def train(model: nn.Module, steps: int, mon: Any = None, lr: float = 1e-2) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if mon is not None:
        mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(**mon))
    losses = []
    for s in range(steps):
        x = tokens(s)
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if mon is not None:
            mon.step(loss)
    if mon is not None:
        mon.detach()
        train.history = list(mon.history)  # type: ignore[attr-defined]
    return losses


@pytest.mark.parametrize("name", ["mixtral", "deepseek-v3", "llama4", "gpt-oss", "qwen2-moe"])
def test_load_equals_a_hand_count_of_the_models_own_routing(name: str) -> None:
    model = build(name)
    seen, handles = own_routing(model)
    train(model, 2, {**QUIET, "every": 1, "log_every": 2})
    for h in handles:
        h.remove()
    history = train.history  # type: ignore[attr-defined]
    assert seen
    for path, calls in seen.items():
        for step, (_, row) in enumerate(history):
            out = calls[step]
            if name == "llama4":  # (scores, logits): the chosen experts are the nonzero scores
                chosen = (out[0] != 0).nonzero()[:, 1]
                n = out[0].shape[-1]
            else:  # (logits, weights, indices)
                chosen, n = out[2].flatten(), out[0].shape[-1]
            hand = torch.bincount(chosen, minlength=n).tolist()
            logged = [row[f"moe/{path}/load[{e}]"] for e in range(n)]
            assert logged == hand
            mean = sum(hand) / n
            assert row[f"moe/{path}/max_vio"] == pytest.approx((max(hand) - mean) / mean)
            assert row[f"moe/{path}/busiest_share"] == pytest.approx(max(hand) / sum(hand))
            std = torch.tensor(hand, dtype=torch.float64).std(unbiased=False).item()
            assert row[f"moe/{path}/cv"] == pytest.approx(std / mean)


def test_router_statistics_equal_a_materialised_computation() -> None:
    model = build("mixtral")
    seen, handles = own_routing(model)
    train(model, 1, {**QUIET, "every": 1, "log_every": 1})
    for h in handles:
        h.remove()
    row = train.history[0][1]  # type: ignore[attr-defined]
    for path, calls in seen.items():
        logits = calls[0][0].double()  # (T, E)
        p = logits.softmax(-1)
        entropy = -(p * p.log()).sum(-1).mean().item()
        top = p.sort(-1, descending=True).values
        margin = (top[:, 1] - top[:, 2]).mean().item()  # k = 2: 2nd minus 3rd probability
        logz = torch.logsumexp(logits, -1)
        assert row[f"moe/{path}/entropy"] == pytest.approx(entropy, rel=1e-5)
        assert row[f"moe/{path}/margin"] == pytest.approx(margin, rel=1e-4, abs=1e-7)
        assert row[f"moe/{path}/logz_mean"] == pytest.approx(logz.mean().item(), rel=1e-5)
        assert row[f"moe/{path}/logz_max"] == pytest.approx(logz.max().item(), rel=1e-5)
        assert row[f"moe/{path}/logit_max"] == pytest.approx(logits.max().item(), rel=1e-5)
        assert entropy < math.log(4)


def test_sigmoid_router_statistics_use_its_scores_and_bias() -> None:
    model = build("deepseek-v3")
    seen, handles = own_routing(model)
    path = "model.layers.1.mlp"  # layer 0 is dense
    router = model.get_submodule(f"{path}.gate")
    with torch.no_grad():
        router.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    train(model, 1, {**QUIET, "every": 1, "log_every": 1})
    for h in handles:
        h.remove()
    row = train.history[0][1]  # type: ignore[attr-defined]
    logits = seen[path][0][0].double()
    s = logits.sigmoid()
    p = s / s.sum(-1, keepdim=True)
    assert row[f"moe/{path}/entropy"] == pytest.approx(-(p * p.log()).sum(-1).mean().item(), rel=1e-5)
    chosen = (s + router.e_score_correction_bias.double()).sort(-1, descending=True).values
    assert row[f"moe/{path}/margin"] == pytest.approx((chosen[:, 1] - chosen[:, 2]).mean().item(), rel=1e-4)


def test_a_planted_dead_expert_is_counted_over_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_mod, "DEAD_WINDOW", 3)
    model = build("gpt-oss")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.bias"):
                p[3] = -1e4  # expert 3 is never in any top-k
    train(model, 5, {**QUIET, "every": 1, "log_every": 5})
    history = train.history  # type: ignore[attr-defined]
    for layer in ("model.layers.0.mlp", "model.layers.1.mlp"):
        dead = [row.get(f"moe/{layer}/dead_experts") for _, row in history]
        assert dead == [None, None, 1.0, 1.0, 1.0]  # written once 3 steps passed
        assert all(row[f"moe/{layer}/load[3]"] == 0 for _, row in history)


def test_observation_only() -> None:
    bare = train(build("mixtral"), 3)
    watched = train(build("mixtral"), 3, {**QUIET, "every": 1, "log_every": 2})
    assert watched == bare  # bit for bit
    assert any(k.startswith("moe/") for k in train.history[0][1])  # type: ignore[attr-defined]


SYNCING = {
    "_local_scalar_dense",
    "nonzero",
    "bincount",
    "unique",
    "_unique2",
    "masked_select",
    "is_nonzero",
    "equal",
}
"""aten ops that read a device value on the host (on CUDA each is a sync)."""


class SyncSpy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name.split("::")[-1]
        if name in SYNCING:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def spying(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[SyncSpy, list[int]]]:
    spy, calls = SyncSpy(), [0]
    real = probe_mod.MoEProbe._measure

    def measured(self: Any, *args: Any) -> Any:
        calls[0] += 1
        with spy:
            return real(self, *args)

    monkeypatch.setattr(probe_mod.MoEProbe, "_measure", measured)
    yield spy, calls


@pytest.mark.parametrize("name", ["mixtral", "llama4"])
def test_the_hook_makes_no_host_sync(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    with spying(monkeypatch) as (spy, calls):
        train(build(name), 2, {**QUIET, "every": 1, "log_every": 2})
    assert calls[0] == 4 and spy.ops == []  # 2 layers x 2 steps measured, no host read


def test_the_spy_sees_a_sync() -> None:
    spy = SyncSpy()
    with spy:
        torch.tensor([1.0]).item()
        torch.bincount(torch.tensor([1, 2]))
    assert spy.ops[:1] == ["_local_scalar_dense"] and "bincount" in spy.ops


def test_unsampled_steps_and_dense_models_record_nothing() -> None:
    train(build("mixtral"), 3, {**QUIET, "every": 2, "log_every": 3})
    steps = [s for s, row in train.history if "moe/model.layers.0.mlp/load[0]" in row]  # type: ignore[attr-defined]
    assert steps == [0, 2]

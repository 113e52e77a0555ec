"""``router_z_loss`` and ``load_balance_loss`` train as the papers' losses would: the parameter
gradients of the model with the intervention equal those of an untouched copy whose loss adds the
term by hand (ST-MoE's mean logsumexp², Switch's E·Σ f·P, written here from the routers' own
outputs), on the reference GPT's MoE preset and the zoo's Hugging Face MoE models; the forward is
unchanged and ``remove`` restores the model bit for bit."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from moe.tiny import build, tokens
from torch import nn

import stabkit
from stabkit.harness.models import GPT, preset_config
from stabkit.interventions import InterventionError, apply
from stabkit.moe import MoEMap

MODELS = ("gpt-moe", "mixtral", "qwen3-moe", "deepseek-v3", "gpt-oss", "llama4", "granitemoe")


def make(name: str) -> nn.Module:
    if name == "gpt-moe":
        torch.manual_seed(0)
        return GPT(preset_config("tiny-moe", d_model=32, context=16)).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build(name)


def batch(name: str) -> torch.Tensor:
    return tokens(1, batch=2, seq=12)


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def task_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model, x)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def routers(model: nn.Module, x: torch.Tensor) -> list[MoEMap]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return stabkit.inspect_model(model, example=x).moe


def routing(model: nn.Module, maps: list[MoEMap]) -> tuple[list[Any], list[Any]]:
    """Forward hooks (the test's own) keeping each router's logits and chosen experts."""
    seen: list[tuple[MoEMap, Any]] = []
    handles = []
    for moe in maps:
        assert moe.logits is not None
        module = model.get_submodule(moe.logits.path)
        handles.append(module.register_forward_hook(lambda m, a, out, moe=moe: seen.append((moe, out))))
    return seen, handles


def hand_z(logits: torch.Tensor) -> torch.Tensor:
    x = logits.float().reshape(-1, logits.shape[-1])
    return (x.exp().sum(-1).log() ** 2).mean()


def hand_balance(logits: torch.Tensor, chosen: torch.Tensor, scoring: str) -> torch.Tensor:
    x = logits.float().reshape(-1, logits.shape[-1])
    n_experts = x.shape[-1]
    f = F.one_hot(chosen.reshape(-1), n_experts).float().mean(0)  # share of the k·N choices
    if scoring == "sigmoid":
        p = x.sigmoid() / x.sigmoid().sum(-1, keepdim=True)
    else:
        p = x.softmax(-1)
    return n_experts * (f * p.mean(0)).sum()


def chosen_of(moe: MoEMap, out: Any, logits: torch.Tensor) -> torch.Tensor:
    if moe.indices is not None:
        idx = moe.indices.take(out)
        assert idx is not None
        return idx
    return logits.topk(moe.top_k, dim=-1).indices  # Llama 4 picks on the logits


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("intervention", "coef"), [("router_z_loss", 0.5), ("load_balance_loss", 0.5)])
def test_gradients_equal_the_loss_written_by_hand(name: str, intervention: str, coef: float) -> None:
    model, x = make(name), batch(name)
    reference = copy.deepcopy(model)
    maps = routers(reference, x)
    seen, hooks = routing(reference, maps)
    extra = torch.zeros(())
    loss = task_loss(reference, x)
    for moe, out in seen:
        assert moe.logits is not None
        logits = moe.logits.take(out)
        assert logits is not None
        if intervention == "router_z_loss":
            extra = extra + hand_z(logits)
        else:
            extra = extra + hand_balance(logits, chosen_of(moe, out, logits), moe.scoring)
    (loss + coef * extra).backward()
    for h in hooks:
        h.remove()
    want = grads(reference)

    handle = apply(model, intervention, coef=coef, example=x)
    plain = task_loss(model, x)
    assert torch.equal(plain.detach(), loss.detach())  # the forward is unchanged
    plain.backward()
    got = grads(model)
    assert set(got) == set(want)
    gate_names = {m.gate_weight for m in maps}
    for n, g in want.items():
        torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=n)
    # the term reached the gates: without it their gradients differ
    bare = copy.deepcopy(reference)
    bare.zero_grad()
    task_loss(bare, x).backward()
    assert any(not torch.allclose(bare.get_parameter(n).grad, want[n]) for n in gate_names)  # type: ignore[arg-type]
    value = handle.metrics()[f"moe/{intervention}"]
    torch.testing.assert_close(value, coef * extra.detach(), rtol=1e-5, atol=1e-7)
    handle.remove()


@pytest.mark.parametrize(
    "intervention", ["router_z_loss", "load_balance_loss", "aux_free_balance", "router_fp32"]
)
def test_remove_restores_the_model_bit_for_bit(intervention: str) -> None:
    model, x = make("gpt-moe"), batch("gpt-moe")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    router = model.get_submodule("blocks.0.mlp.router")
    before = logits_of(model, x)
    handle = apply(model, intervention, example=x)
    assert "forward" in router.__dict__
    task_loss(model, x).backward()
    handle.remove()
    assert "forward" not in router.__dict__ and not any(k.startswith("_stabkit") for k in router.__dict__)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.equal(logits_of(model, x), before)


def test_router_interventions_stack_and_come_off_in_any_order() -> None:
    model, x = make("gpt-moe"), batch("gpt-moe")
    before = logits_of(model, x)
    a = apply(model, "router_z_loss", example=x)
    b = apply(model, "aux_free_balance", example=x)
    c = apply(model, "load_balance_loss", example=x)
    assert torch.equal(logits_of(model, x), before)
    a.remove()
    c.remove()
    assert "forward" in model.get_submodule("blocks.1.mlp.router").__dict__
    b.remove()
    assert "forward" not in model.get_submodule("blocks.1.mlp.router").__dict__
    assert torch.equal(logits_of(model, x), before)


def test_a_model_without_a_router_is_refused_by_name() -> None:
    torch.manual_seed(0)
    model = GPT(preset_config("tiny", d_model=32, context=16))
    for name in ("router_z_loss", "load_balance_loss", "aux_free_balance", "router_fp32"):
        with pytest.raises(InterventionError, match=rf"^{name}: .*no mixture-of-experts router found"):
            apply(model, name, example=batch("gpt-moe"))


class CastRouter(nn.Module):
    """A router whose gate is F.linear on a float64 copy of its weight: discovery finds the router,
    the router interventions cannot reach its projection (a copy they do not follow)."""

    def __init__(self, d: int = 8, e: int = 4, k: int = 2) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(e, d) / d**0.5)
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.double(), self.weight.double()).float()
        w, idx = logits.softmax(-1).topk(self.k, dim=-1)
        return logits, w, idx


class CastMoE(nn.Module):
    def __init__(self, d: int = 8, e: int = 4) -> None:
        super().__init__()
        self.router = CastRouter(d, e)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, w, idx = self.router(x)
        outs = torch.stack([f(x) for f in self.experts], -2)  # (N, E, d)
        picked = outs.gather(-2, idx[..., None].expand(*idx.shape, x.shape[-1]))
        return x + (w[..., None] * picked).sum(-2)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = CastMoE(), CastMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_gate_stabkit_cannot_reach_is_refused_at_apply_time() -> None:
    torch.manual_seed(0)
    model, x = TwoLayers(), torch.randn(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = stabkit.inspect_model(model, example=x).moe
        assert len(found) == 2 and all(m.gate_weight for m in found)
        with pytest.raises(
            InterventionError,
            match=r"^router_z_loss: .*not in effect: the router ran without a gate projection \(F.linear",
        ):
            apply(model, "router_z_loss", example=x)
        assert not any("forward" in m.__dict__ for m in model.modules())  # nothing left behind
        # aux_free_balance acts at the top-k only: it takes this router
        apply(model, "aux_free_balance", example=x).remove()


def test_a_registered_router_is_refused_by_name() -> None:
    from moe.test_find import SortMoE, SortRouter

    from stabkit.moe import register_router, unregister_router

    torch.manual_seed(0)
    model, x = nn.Sequential(SortMoE(), SortMoE()), torch.randn(5, 8)
    register_router(SortRouter, n_experts="n", top_k="k", logits=0, indices=1)
    try:
        with pytest.raises(
            InterventionError, match=r"^load_balance_loss: cannot apply to 0.router: .*registered"
        ):
            apply(model, "load_balance_loss", example=x)
    finally:
        unregister_router(SortRouter)


@pytest.mark.parametrize("name", ["gpt-moe", "mixtral", "deepseek-v3"])
def test_discovery_still_finds_the_routers_with_every_router_intervention_on(name: str) -> None:
    # the recipes and attach(interventions=) apply first, then the monitor discovers the model
    model, x = make(name), batch(name)
    before = [(m.path, m.router, m.n_experts, m.top_k, m.scoring) for m in routers(model, x)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle = apply(
            model, ["router_fp32", "router_z_loss", "load_balance_loss", "aux_free_balance"], example=x
        )
        found = stabkit.inspect_model(model, example=tokens(5, batch=2, seq=12)).moe
    assert [(m.path, m.router, m.n_experts, m.top_k, m.scoring) for m in found] == before
    handle.remove()

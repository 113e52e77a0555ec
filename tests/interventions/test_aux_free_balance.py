"""``aux_free_balance`` is DeepSeek-V3's bias: nothing changes at the switch; after an optimizer step the
bias is gamma·sign(mean load − load) of the load counted by hand from the router's own choice; the
next choice is the top-k of scores + bias (computed here from the router's logits) while the weights
stay the unbiased scores; the bias takes no gradient; DeepSeek-V3's own score bias is the one moved,
and put back bit for bit by ``remove``."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from moe.tiny import build, tokens
from torch import nn

from stabkit.harness.models import GPT, preset_config
from stabkit.interventions import apply, attach_optimizer

GAMMA = 0.0625  # exact in float32


def gpt_moe() -> nn.Module:
    torch.manual_seed(0)
    return GPT(preset_config("tiny-moe", d_model=32, context=16)).train()


def batch() -> torch.Tensor:
    return tokens(3, batch=4, seq=16)


def router_outputs(model: nn.Module, paths: list[str]) -> tuple[dict[str, list[Any]], list[Any]]:
    seen: dict[str, list[Any]] = {p: [] for p in paths}
    hooks = [
        model.get_submodule(p).register_forward_hook(lambda m, a, out, p=p: seen[p].append(out))
        for p in paths
    ]
    return seen, hooks


ROUTERS = ["blocks.0.mlp.router", "blocks.1.mlp.router"]


def test_the_bias_follows_the_hand_counted_load_and_moves_the_choice_only() -> None:
    model, x = gpt_moe(), batch()
    before = model(x)
    handle = apply(model, "aux_free_balance", gamma=GAMMA, example=x)
    seen, hooks = router_outputs(model, ROUTERS)
    out = model(x)
    assert torch.equal(out, before)  # unchanged at the switch
    handle.update()  # what the optimizer step post-hook calls
    for path, balancer in zip(ROUTERS, handle.balancers, strict=True):
        _, _, indices = seen[path][0]
        load = torch.bincount(indices.reshape(-1), minlength=8).float()
        want = GAMMA * torch.sign(load.mean() - load)
        assert torch.equal(balancer.bias, want) and not balancer.bias.requires_grad
        assert bool((want != 0).any())
    for hook_list in seen.values():
        hook_list.clear()
    model(x)
    moved = False
    for path, balancer in zip(ROUTERS, handle.balancers, strict=True):
        logits, weights, indices = seen[path][0]
        probs = logits.float().softmax(-1)
        picked = (probs + balancer.bias).topk(2, dim=-1).indices
        assert torch.equal(indices, picked)
        unbiased = probs.gather(-1, picked)
        torch.testing.assert_close(weights, unbiased / unbiased.sum(-1, keepdim=True))
        moved |= not torch.equal(picked, probs.topk(2, dim=-1).indices)
    assert moved  # the bias changed some token's choice
    for h in hooks:
        h.remove()
    handle.remove()
    assert torch.equal(model(x), before)


def test_the_bias_moves_after_each_optimizer_step_and_only_on_training_forwards() -> None:
    model, x = gpt_moe(), batch()
    handle = apply(model, "aux_free_balance", gamma=GAMMA, example=x)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    attach_optimizer(handle, opt)
    with torch.no_grad():
        model(x)  # an evaluation forward: not counted
    opt.step()
    assert all(torch.equal(b.bias, torch.zeros(8)) for b in handle.balancers)
    model(x).sum().backward()
    opt.step()
    assert all(b.bias.abs().max() == GAMMA for b in handle.balancers)
    assert all(float(b.load.sum()) == 0 for b in handle.balancers)  # counts restart after the update
    assert float(handle.metrics()["moe/aux_free_bias_absmax"]) == GAMMA
    handle.remove()
    opt.step()  # the hook went with the handle
    assert handle.balancers[0].bias.abs().max() == GAMMA


def test_deepseek_v3_s_own_score_bias_is_moved_and_restored() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build("deepseek-v3")
        x = tokens(1, batch=2, seq=12)
        path = "model.layers.1.mlp.gate"
        own = model.get_buffer(f"{path}.e_score_correction_bias")
        kept = own.clone()
        handle = apply(model, "aux_free_balance", gamma=GAMMA, example=x)
        seen, hooks = router_outputs(model, [path])
        model(x)
        handle.update()
    _, _, indices = seen[path][0]
    load = torch.bincount(indices.reshape(-1), minlength=8).float()
    torch.testing.assert_close(own, kept + GAMMA * torch.sign(load.mean() - load))
    assert len(handle.balancers) == 1 and not handle.balancers[0].own  # no bias of stabkit's added
    for h in hooks:
        h.remove()
    handle.remove()
    assert torch.equal(own, kept)

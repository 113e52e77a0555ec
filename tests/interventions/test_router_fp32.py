"""``router_fp32`` computes the gate projection in float32 under bfloat16 autocast: the router logits
equal a float32 F.linear of the same input (and differ from the bfloat16 ones it made before), the
gate weight still gets its gradient, and without autocast nothing changes."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from moe.tiny import build, tokens
from torch import nn

from stabkit.harness.models import GPT, preset_config
from stabkit.interventions import apply


def gpt_moe() -> nn.Module:
    torch.manual_seed(0)
    return GPT(preset_config("tiny-moe", d_model=32, context=16)).train()


def gate_call(model: nn.Module, path: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the router's input, its logits) in one bf16-autocast forward."""
    seen: list[Any] = []
    hook = model.get_submodule(path).register_forward_hook(lambda m, a, out: seen.append((a[0], out[0])))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    (out if isinstance(out, torch.Tensor) else out.logits).float().sum().backward()
    hook.remove()
    return seen[0]


def test_router_logits_are_float32_under_bf16_autocast() -> None:
    model, x = gpt_moe(), tokens(2, batch=2, seq=16)
    path = "blocks.1.mlp.router"
    weight = model.get_parameter(f"{path}.gate.weight")
    _, plain = gate_call(model, path, x)
    assert plain.dtype == torch.bfloat16
    model.zero_grad()
    handle = apply(model, "router_fp32", example=x)
    inp, logits = gate_call(model, path, x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(inp.detach().float(), weight.detach().float()))
    assert not torch.equal(logits, F.linear(inp.detach().bfloat16(), weight.detach().bfloat16()).float())
    assert weight.grad is not None and bool(weight.grad.abs().sum() > 0)
    handle.remove()


def test_without_autocast_nothing_changes() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, x = build("qwen3-moe"), tokens(1)
        before = model(x).logits
        handle = apply(model, "router_fp32", example=x)
        assert torch.equal(model(x).logits, before)
        handle.remove()

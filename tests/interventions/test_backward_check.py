"""The apply-time check runs one backward through each changed kernel call (issue 38, item 1, last sentence).

Two registered custom ops compute the same soft-capped attention forward; the "honest" one's autograd
formula differentiates what it computed, the "forgetful" one's differentiates the uncapped attention — a
kernel whose backward does not see its own cap, the failure issue 38 found in flash-attn's Function. The
check compares autograd's directional derivative with a central difference of the changed forward: the
honest kernel passes, the forgetful one makes ``apply`` raise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from stabkit.attention.kernels import forget_kernel, register_kernel
from stabkit.interventions import InterventionError, apply
from stabkit.interventions.backward_check import directional_error

torch.set_num_threads(1)
CAP = 0.5


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, L, S)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    return torch.softmax(s, dim=-1) @ v


def _define(name: str, backward_cap: bool) -> Any:
    op = torch.library.custom_op(f"stabkit_bwcheck::{name}", mutates_args=())(_forward)
    op.register_fake(lambda q, k, v, softcap: torch.empty_like(q))

    def setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        q, k, v, softcap = inputs
        ctx.save_for_backward(q, k, v)
        ctx.softcap = softcap if backward_cap else 0.0  # the forgetful one drops its cap here

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _math(q, k, v, ctx.softcap)
        return (*torch.autograd.grad(out, (q, k, v), grad), None)

    op.register_autograd(backward, setup_context=setup)
    return op


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float) -> torch.Tensor:
    return _math(q, k, v, softcap)


OPS = {"honest": _define("honest", True), "forgetful": _define("forgetful", False)}


class Attention(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.qkv, self.o = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        y = getattr(torch.ops.stabkit_bwcheck, self.op)(q * 3, k * 3, v, 0.0)
        return self.o(y.transpose(1, 2).reshape(b, t, 16))


class Net(nn.Module):
    def __init__(self, op: str) -> None:
        super().__init__()
        self.attn = Attention(op)
        self.head = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.attn(x))


@pytest.fixture
def registered() -> Any:
    kernels = [register_kernel(f"stabkit_bwcheck::{n}", layout="bhsd", softcap="softcap") for n in OPS]
    yield
    for kernel in kernels:
        forget_kernel(kernel.name)


def _example() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))


def test_a_kernel_whose_backward_sees_its_cap_passes(registered: None) -> None:
    torch.manual_seed(0)
    handle = apply(Net("honest").double(), "attn_softcap", cap=CAP, example=_example().double())
    assert handle.counts == {"attn": 1} and handle.changed_calls == {}
    handle.remove()


def test_a_kernel_whose_backward_forgets_its_cap_is_refused_at_apply(registered: None) -> None:
    torch.manual_seed(0)
    model = Net("forgetful").double()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InterventionError, match="backward disagrees with its forward"):
        apply(model, "attn_softcap", cap=CAP, example=_example().double())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_directional_check_by_numbers(registered: None, dtype: torch.dtype) -> None:
    from stabkit.attention import kernels

    q, k, v = (
        torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(i), dtype=dtype) * 3 for i in range(3)
    )

    def cap(arguments: dict[str, Any]) -> None:
        arguments["softcap"] = CAP

    results = {}
    for name, op in (
        ("honest", torch.ops.stabkit_bwcheck.honest),
        ("forgetful", torch.ops.stabkit_bwcheck.forgetful),
    ):
        kernel = kernels.lookup(op)
        assert kernel is not None
        results[name] = directional_error(kernel, op, (q, k, v, 0.0), {}, cap)
    honest, forgetful = results["honest"], results["forgetful"]
    assert honest is not None and forgetful is not None
    assert honest[0] < honest[1] / 10  # agrees to rounding
    assert forgetful[0] > 0.2  # the uncapped backward is far off

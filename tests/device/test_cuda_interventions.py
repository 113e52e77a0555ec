"""Interventions on the device change the backward too (issue 38, item 5): ``attn_softcap`` and
``qk_norm`` applied to a model attending through SDPA (CUDA: its fused backends) or FlexAttention give
the parameter gradients of the same model capping (math attention with the cap / FlexAttention with a
capping ``score_mod``) or normalising q and k itself. Run by `tests/device/run_checks.sh` on a lent CUDA
device; the CPU twin runs SDPA here (FlexAttention has no backward on a CPU).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stabkit.attention.math import math_attention, softcap_score_mod
from stabkit.interventions import apply

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CASES = [
    ("cpu", "sdpa"),
    pytest.param("cuda", "sdpa", marks=CUDA),
    pytest.param("cuda", "flex", marks=CUDA),
]
D, H, T = 32, 4, 16
HD = D // H
CAP, EPS = 0.8, 1e-6


class Attention(nn.Module):
    """`own` = 'cap': the reference capping itself; 'norm': the reference normalising q and k itself."""

    def __init__(self, path: str, own: str = "") -> None:
        super().__init__()
        self.path, self.own = path, own
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        nn.init.normal_(self.qkv.weight, std=0.6)  # logits of a few units: the cap matters
        if own == "norm":
            self.q_gain, self.k_gain = nn.Parameter(torch.ones(HD)), nn.Parameter(torch.ones(HD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, HD).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        if self.own == "norm":
            q = F.rms_norm(q, (HD,), self.q_gain, EPS)
            k = F.rms_norm(k, (HD,), self.k_gain, EPS)
        if self.path == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            score_mod = softcap_score_mod(CAP) if self.own == "cap" else None
            y = flex_attention(q, k, v, score_mod=score_mod)
        elif self.own == "cap":
            y = math_attention(q, k, v, is_causal=True, softcap=CAP)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, D))


class Net(nn.Module):
    def __init__(self, path: str, own: str = "") -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(path, own) for _ in range(2))
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _pair(device: str, path: str, own: str) -> tuple[Net, Net]:
    torch.manual_seed(0)
    plain = Net(path).to(device)
    ref = Net(path, own).to(device)
    ref.load_state_dict(plain.state_dict(), strict=False)
    return plain, ref


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rename(name: str) -> str:  # blocks.0.stabkit_qk_norm.q.weight -> blocks.0.q_gain
    for which in ("q", "k"):
        name = name.replace(f"stabkit_qk_norm.{which}.weight", f"{which}_gain")
    return name


@pytest.mark.parametrize(("device", "path"), CASES)
@pytest.mark.parametrize(
    ("name", "own", "options"), [("attn_softcap", "cap", {"cap": CAP}), ("qk_norm", "norm", {"eps": EPS})]
)
def test_intervention_backward_matches_the_reference(
    device: str, path: str, name: str, own: str, options: dict[str, Any]
) -> None:
    model, ref = _pair(device, path, own)
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(1)).to(device)
    handle = apply(model, name, example=x, **options)
    loss, grads = _grads(model, x)
    want_loss, want = _grads(ref, x)
    torch.testing.assert_close(loss, want_loss, rtol=1e-4, atol=1e-6)
    assert {_rename(n) for n in grads} == set(want), (sorted(grads), sorted(want))
    for n, g in grads.items():
        torch.testing.assert_close(g, want[_rename(n)], rtol=1e-3, atol=1e-5, msg=n)
    handle.remove()
    plain_loss, _ = _grads(model, x)
    assert not torch.allclose(plain_loss, want_loss, rtol=1e-4)  # the change is not a no-op here

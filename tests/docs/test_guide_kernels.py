"""The guide's "Attention kernels" example (docs/guide/kernels.md) runs as written: its custom op, once registered, is
discovered, measured (max logit equal to a float64 reference) and normalised by qk_norm."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from standins.reference import reference_stats
from torch import nn

import stabkit
from stabkit.attention import kernels

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "kernels.md"
"""The guide page (the README's section before the docs site)."""


def section_code() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def registered() -> Any:
    namespace: dict[str, Any] = {}
    (block,) = section_code()
    exec(compile(block, str(PAGE), "exec"), namespace)  # defines and registers mylib::attention
    yield namespace
    kernels.forget_kernel("mylib.attention")


class Attention(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1) for p in (self.q, self.k, self.v))  # (B, T, H, D)
        y = torch.ops.mylib.attention(q, k, v, True, 0.5)
        return self.o(y.reshape(b, t, d))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(32), "attn": Attention()}) for _ in range(2)
        )
        self.head = nn.Linear(32, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block["attn"](block["ln"](x))
        return self.head(x)


def test_the_readme_kernel_is_discovered_measured_and_normalised(registered: Any) -> None:
    torch.manual_seed(0)
    model = LM()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.blocks[1]["attn"].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    cfg = stabkit.MonitorConfig.full(attn_sample_rows=None, attn_sample_queries=None, console=False)
    with stabkit.attach(model, config=cfg) as mon:
        idx = torch.randint(0, 50, (2, 9))
        model(idx)  # (the page's op registers no autograd formula: a forward is enough here)
        mon.step()
    assert [a.impl for a in mon.model_map.attentions] == ["kernel:mylib.attention"] * 2
    attn = model.blocks[1]["attn"]
    x = seen[-1]
    q, k = (p(x).view(2, 9, 4, -1).transpose(1, 2) for p in (attn.q, attn.k))
    want = reference_stats(q, k, scale=0.5, causal=True)["max_logit"].max()
    assert mon.metrics["attn/blocks.1.attn/max_logit"] == pytest.approx(float(want), rel=1e-5)
    handle = stabkit.interventions.apply(model, "qk_norm")  # verified in effect at the call
    assert len(handle.new_parameters()) == 4
    handle.remove()

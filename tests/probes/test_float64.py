"""A float64 model keeps every probe family, and each value equals a float64 computation by hand.

The fault: the whole reference GPT in float64 (``model.double()``), where torch refuses to narrow a
float64 norm to float32 inside ``vector_norm(..., dtype=float32)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.stats import foreach_norm_f32, norm_f32, tensor_stats

CFG = stabkit.MonitorConfig(
    every=1,
    log_every=1,
    console=False,
    audit=False,
    strict=True,  # a failing probe raises instead of warning and switching itself off
    attn_sample_rows=None,
    attn_sample_queries=None,
)
OUTPUTS = ("blocks.0", "blocks.1.attn", "blocks.1.mlp", "head")


FORWARD = frozenset({"act", "attn", "logits", "loss"})


def run(families: frozenset[str]) -> tuple[nn.Module, dict[str, float], dict[str, Any]]:
    """One monitored SGD step of the float64 reference GPT, with what the test needs to recompute."""
    torch.manual_seed(0)
    model = reference_gpt().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = stabkit.attach(model, opt, config=dataclasses.replace(CFG, families=families))
    seen: dict[str, Any] = {}
    handles = []
    for path in OUTPUTS:

        def out_hook(m: nn.Module, a: Any, out: torch.Tensor, path: str = path) -> None:
            seen[path] = out.detach().clone()

        handles.append(model.get_submodule(path).register_forward_hook(out_hook))
    for i, block in enumerate(model.blocks):

        def in_hook(m: nn.Module, a: tuple[torch.Tensor, ...], i: int = i) -> None:
            with torch.no_grad():  # the weights as this forward sees them (the step changes them)
                seen[f"attn.{i}"] = attention_by_hand(m, a[0])

        handles.append(block.attn.register_forward_pre_hook(in_hook))
    idx, tgt = batch(0)
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    seen["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    seen["before"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    mon.step(loss)
    mon.detach()
    for h in handles:
        h.remove()
    seen["loss"] = loss.item()
    return model, dict(mon.metrics), seen


def close(got: float, want: float, what: str) -> None:
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7), f"{what}: probe {got} vs hand {want}"


def attention_by_hand(attn: nn.Module, x: torch.Tensor) -> tuple[float, float, float]:
    """(max |logit|, mean entropy, min head entropy) of the reference GPT's causal attention, float64."""
    B, T, _ = x.shape
    H, hd = attn.n_heads, attn.head_dim
    q = attn.q_proj(x).view(B, T, H, hd).transpose(1, 2)
    k = attn.k_proj(x).view(B, T, H, hd).transpose(1, 2)
    logits = q @ k.transpose(-1, -2) / math.sqrt(hd)  # (B, H, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = torch.softmax(logits.masked_fill(~causal, -math.inf), dim=-1)
    row_h = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)  # (B, H, T)
    top = logits.abs().masked_fill(~causal, 0).max()
    return top.item(), row_h.mean().item(), row_h.mean(dim=(0, 2)).min().item()


def cat_norm(tensors: list[torch.Tensor]) -> float:
    return torch.cat([t.flatten() for t in tensors]).norm().item()


def test_float64_forward_families_equal_hand_computation() -> None:
    model, m, seen = run(FORWARD)
    assert {k.split("/")[0] for k in m} >= FORWARD
    for path in OUTPUTS[:-1]:
        out = seen[path]
        close(m[f"act/{path}/rms"], out.pow(2).mean().sqrt().item(), f"{path} rms")
        close(m[f"act/{path}/absmax"], out.abs().max().item(), f"{path} absmax")
        assert m[f"act/{path}/nonfinite"] == 0
    logits = seen["head"]
    logz = torch.logsumexp(logits, dim=-1)
    close(m["logits/max_abs"], logits.abs().max().item(), "logits max_abs")
    close(m["logits/logz_mean"], logz.mean().item(), "logz mean")
    close(m["logits/logz_max"], logz.max().item(), "logz max")
    close(m["logits/mean"], logits.mean().item(), "logit mean")
    close(m["loss"], seen["loss"], "loss")
    for i in range(len(model.blocks)):
        want = seen[f"attn.{i}"]
        for stat, value in zip(("max_logit", "entropy", "min_head_entropy"), want, strict=True):
            close(m[f"attn/blocks.{i}.attn/{stat}"], value, f"block {i} {stat}")


def test_float64_gradient_families_equal_hand_computation() -> None:
    model, m, seen = run(stabkit.MonitorConfig().families)  # every family; strict: a failing probe raises
    assert {k.split("/")[0] for k in m} >= FORWARD | {"grad", "param", "update"}
    grads, before = seen["grads"], seen["before"]
    close(m["grad/global_norm"], cat_norm(list(grads.values())), "global grad norm")
    after = dict(model.named_parameters())
    for unit in ("blocks.0", "blocks.1"):
        names = [n for n in grads if n.startswith(unit + ".")]
        close(m[f"grad/{unit}/norm"], cat_norm([grads[n] for n in names]), f"{unit} grad norm")
        close(m[f"param/{unit}/norm"], cat_norm([before[n] for n in names]), f"{unit} param norm")
        delta = [after[n].detach() - before[n] for n in names]
        ratio = cat_norm(delta) / cat_norm([before[n] for n in names])
        assert m[f"update/{unit}/ratio"] == pytest.approx(ratio, rel=1e-4), unit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_norm_helpers_accept_every_float_dtype(dtype: torch.dtype) -> None:
    x = torch.tensor([[3.0, 4.0], [6.0, 8.0]], dtype=dtype)
    assert norm_f32(x).dtype == torch.float32 and norm_f32(x).item() == pytest.approx(math.sqrt(125))
    assert norm_f32(x, dim=-1).tolist() == [5.0, 10.0]
    mixed = [x, x.float(), torch.zeros(0, dtype=dtype)]
    assert [n.item() for n in foreach_norm_f32(mixed)] == pytest.approx([math.sqrt(125)] * 2 + [0.0])
    assert all(n.dtype == torch.float32 for n in foreach_norm_f32(mixed))
    rms, absmax, nonfinite = tensor_stats(x)
    assert rms.item() == pytest.approx(math.sqrt(125 / 4)) and absmax.item() == 8 and nonfinite.item() == 0

"""Activation checkpointing (reentrant or not) recomputes each block's forward during backward; the
forward hooks that run again there must not count a second time.

The fault: an Inf weight in block 0's MLP makes one column of its output non-finite at every
position, and everything downstream (block 1's attention, recomputed in backward before the
non-reentrant recomputation stops early) non-finite. The expectations are independent of stabkit's
counting: the same model without checkpointing gives the same metrics, and each non-finite count
is that of the output the test captured.
"""

from __future__ import annotations

import math
import types
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from zoo import batch, hf_llama, lm_loss, reference_gpt

import stabkit

WATCHED = ("blocks.0.mlp", "blocks.1.attn", "blocks.1")
CFG = stabkit.MonitorConfig(
    every=1,
    log_every=1,
    console=False,
    audit=False,
    detect=None,
    attn_sample_rows=None,
    attn_sample_queries=None,
    modules="*",
)


def checkpointed_forward(reentrant: bool) -> Any:
    """The reference GPT's forward with every block under torch.utils.checkpoint (as HF models do:
    the module itself is checkpointed, so its hooks and its children's run again in backward)."""

    def forward(self: nn.Module, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1])))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        return self.head(self.final_norm(x))

    return forward


class Holder(nn.Module):
    """Like a LightningModule: attached to, but its own forward is never called (training calls
    ``holder.model(x)``), so only the inner model's forward tells a training forward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def run(mode: str, fault: bool, wrapped: bool = False) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One monitored training step; returns the metrics and the outputs captured on the first forward."""
    torch.manual_seed(0)
    model = reference_gpt()
    if mode != "plain":
        model.forward = types.MethodType(checkpointed_forward(mode == "reentrant"), model)  # type: ignore[method-assign]
    if fault:
        with torch.no_grad():
            model.blocks[0].mlp.proj.weight[0, 0] = math.inf
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = stabkit.attach(Holder(model) if wrapped else model, opt, config=CFG)
    seen: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}
    handles = []
    for path in WATCHED:

        def capture(module: nn.Module, args: Any, out: torch.Tensor, path: str = path) -> None:
            calls[path] = calls.get(path, 0) + 1
            seen.setdefault(path, out.detach().clone())

        handles.append(model.get_submodule(path).register_forward_hook(capture))
    idx, tgt = batch(0)
    loss = lm_loss(model(idx), tgt)
    loss.backward()
    opt.step()
    mon.step(loss)
    mon.detach()
    for h in handles:
        h.remove()
    assert calls["blocks.1.attn"] == (1 if mode == "plain" else 2)  # the recomputation ran the hooks again
    if not wrapped:
        return dict(mon.metrics), seen
    # the wrapper's names: "model." in front, and the inner model's own output ("act/model/...") too
    return {
        k.replace("model.", "", 1): v for k, v in mon.metrics.items() if not k.startswith("act/model/")
    }, seen


def assert_same(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    diff = {
        k: (got[k], want[k])
        for k in got
        if got[k] != want[k] and not (math.isnan(got[k]) and math.isnan(want[k]))
    }
    assert not diff


@pytest.mark.parametrize("wrapped", [False, True], ids=["model", "wrapper"])
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
@pytest.mark.parametrize("fault", [True, False], ids=["inf-weight", "clean"])
def test_checkpointed_blocks_give_the_statistics_of_the_plain_model(
    mode: str, fault: bool, wrapped: bool
) -> None:
    plain, seen = run("plain", fault)
    checkpointed, _ = run(mode, fault, wrapped)
    assert_same(checkpointed, plain)
    for path in WATCHED:
        want = int((~torch.isfinite(seen[path])).sum())
        assert checkpointed[f"act/{path}/nonfinite"] == want, path
    positions = seen["blocks.0.mlp"].shape[0] * seen["blocks.0.mlp"].shape[1]
    assert checkpointed["act/blocks.0.mlp/nonfinite"] == (positions if fault else 0)
    assert checkpointed["act/blocks.1.attn/nonfinite"] == (seen["blocks.1.attn"].numel() if fault else 0)
    assert {k.split("/")[0] for k in checkpointed} >= {"act", "attn", "logits", "grad", "loss"}


def run_hf(reentrant: bool | None) -> dict[str, float]:
    """One monitored step of a tiny Llama with an Inf weight; `reentrant` None = no checkpointing,
    else HF's own gradient checkpointing of every decoder layer with that `use_reentrant`."""
    torch.manual_seed(0)
    model = hf_llama("sdpa", kv_heads=2).train()
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with torch.no_grad():  # the fault: layer 0's MLP output, and all after it, non-finite
        model.model.layers[0].mlp.down_proj.weight[0, 0] = math.inf
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = stabkit.attach(model, opt, config=CFG)
    idx, tgt = batch(0)
    loss = lm_loss(model(idx).logits, tgt)
    loss.backward()
    opt.step()
    mon.step(loss)
    mon.detach()
    return dict(mon.metrics)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_hf_gradient_checkpointing_gives_the_statistics_of_the_plain_model(reentrant: bool) -> None:
    plain = run_hf(None)
    assert_same(run_hf(reentrant), plain)
    assert {k.split("/")[0] for k in plain} >= {"act", "attn", "logits", "grad", "loss"}
    assert plain["act/model.layers.1.self_attn/nonfinite"] > 0  # the fault reached the counts

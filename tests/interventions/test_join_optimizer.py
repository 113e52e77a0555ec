"""`join_optimizer` (stabkit/interventions/registry.py): the one place that wires switched-on
interventions into an existing optimizer — new gains as one decay-free group, post-step fixes watching
it — used by attach(..., interventions=) and the rescue."""

from __future__ import annotations

import torch

from stabkit.harness.models import GPT, GPTConfig
from stabkit.interventions import apply, join_optimizer


def test_new_gains_join_as_one_group_without_weight_decay() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    before = len(opt.param_groups)
    handle = apply(model, "qk_norm")
    group = join_optimizer(handle, opt)
    assert group is not None and len(opt.param_groups) == before + 1 and opt.param_groups[-1] is group
    assert group["weight_decay"] == 0.0 and group["lr"] == 1e-3
    assert {id(p) for p in group["params"]} == {id(p) for p in handle.new_parameters()}
    assert len(group["params"]) == 2 * 2  # a q and a k gain per layer


def test_a_post_step_fix_watches_the_optimizer_and_adds_no_group() -> None:
    clipped = {}
    for joined in (True, False):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layers=1))
        opt = torch.optim.SGD(model.parameters(), lr=10.0)
        handle = apply(model, "qk_clip", tau=1.0)
        if joined:
            assert join_optimizer(handle, opt) is None and len(opt.param_groups) == 1
        x = torch.randint(0, 256, (2, 16))
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()  # a huge step: every head past tau 1
        clipped[joined] = handle.metrics().get("qk_clip/blocks.0.attn/heads_clipped")
    # joined, qk_clip saw the step and clipped the 4 heads; not joined, it never ran
    assert clipped[True] is not None and float(clipped[True]) == 4.0 and clipped[False] is None


def test_no_optimizer_nothing_to_join() -> None:
    model = GPT(GPTConfig(n_layers=1))
    assert join_optimizer(apply(model, "qk_norm"), None) is None

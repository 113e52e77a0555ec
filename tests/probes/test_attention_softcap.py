"""The attention probe under soft capping: the model's own cap (only capped logits visible) and the
attn_softcap intervention (an outer mode; the probe, innermost, sees the raw call)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import stabkit

from .test_attention import CASES, EXACT, QK, assert_close, causal_and_keys, heads, reference, sharpen


def test_model_softcap_reports_raw_and_capped_max() -> None:
    """Reference GPT with attn_softcap caps inside its own eager path: the probe sees capped logits,
    reports them as max_logit_capped and recovers the raw max by inverting the cap."""
    cap = 2.0
    torch.manual_seed(0)
    model = zoo.reference_gpt(attn_softcap=cap)
    model.train()
    paths = stabkit.inspect_model(model).attention_paths
    captured: dict[str, QK] = {}
    for p in paths:
        model.get_submodule(p).register_forward_pre_hook(
            lambda m, a, kw, _p=p: captured.__setitem__(_p, tuple(t.detach() for t in qk_nanogpt_like(m, a))),
            with_kwargs=True,
        )
    idx, _ = zoo.batch(2)
    with stabkit.attach(model, None, config=EXACT, logdir=None) as mon:
        model(idx)
        mon.step()
        mon.flush()
    got = mon.metrics
    allowed = causal_and_keys(idx.shape[1], None)
    for p in paths:
        q, k = captured[p]
        want = reference(q, k, allowed, cap=cap)
        assert cap < want["max_logit"] < 4 * cap  # the cap is active, not saturated in float32
        assert_close(got[f"attn/{p}/max_logit"], want["max_logit"], "raw max")
        assert_close(
            got[f"attn/{p}/max_logit_capped"], cap * math.tanh(want["max_logit"] / cap), "capped max"
        )
        assert_close(got[f"attn/{p}/entropy"], want["entropy"], "entropy of the capped distribution")
        assert_close(got[f"attn/{p}/min_head_entropy"], want["min_head_entropy"], "min head entropy")


def qk_nanogpt_like(m: nn.Module, args: tuple) -> QK:
    """q, k of the reference GPT with learned positions (no RoPE), MHA."""
    x = args[0]
    return heads(F.linear(x, m.q_proj.weight), m.n_heads), heads(F.linear(x, m.k_proj.weight), m.n_heads)


@pytest.mark.parametrize("probe_first", [True, False], ids=["probe-first", "intervention-first"])
@pytest.mark.parametrize("case", ["reference-rope-gqa", "hf_llama-eager-gqa", "encoder-pre"])
def test_softcap_intervention_probe_sees_raw_logits(case: str, probe_first: bool) -> None:
    """With the attn_softcap intervention (an outer mode), the probe (innermost) still sees the raw
    call: max_logit is raw, max_logit_capped = cap·tanh(max/cap), entropy is the capped distribution's."""
    from stabkit.interventions import apply

    build, qk_of, factor = CASES[case]
    torch.manual_seed(0)
    model = build()
    model.train()
    paths = stabkit.inspect_model(model).attention_paths
    sharpen(model, paths, factor)
    idx, _ = zoo.batch(3)
    first = zoo.forward_logits(model, idx).detach()
    captured: dict[str, QK] = {}
    for p in paths:
        model.get_submodule(p).register_forward_pre_hook(
            lambda m, a, kw, _p=p: captured.__setitem__(_p, tuple(t.detach() for t in qk_of(m, a, kw))),
            with_kwargs=True,
        )
    cap = 1.0
    if probe_first:
        mon = stabkit.attach(model, None, config=EXACT, logdir=None)
        handle = apply(model, "attn_softcap", cap=cap)
    else:
        handle = apply(model, "attn_softcap", cap=cap)
        mon = stabkit.attach(model, None, config=EXACT, logdir=None)
    capped_out = zoo.forward_logits(model, idx).detach()
    mon.step()
    mon.flush()
    mon.detach()
    handle.remove()
    assert not torch.equal(first, capped_out)  # the cap is really applied
    got = mon.metrics
    for p in paths:
        q, k = captured[p]
        raw = reference(q, k, causal_and_keys(idx.shape[1], None))
        capped = reference(q, k, causal_and_keys(idx.shape[1], None), cap=cap)
        assert raw["max_logit"] > 1.5 * cap
        assert_close(got[f"attn/{p}/max_logit"], raw["max_logit"], "raw max")
        assert_close(got[f"attn/{p}/max_logit_capped"], cap * math.tanh(raw["max_logit"] / cap), "capped max")
        assert_close(got[f"attn/{p}/entropy"], capped["entropy"], "entropy of the capped distribution")
        assert_close(got[f"attn/{p}/min_head_entropy"], capped["min_head_entropy"], "capped min head entropy")
        assert abs(capped["entropy"] - raw["entropy"]) > 1e-3  # the cap changes the distribution

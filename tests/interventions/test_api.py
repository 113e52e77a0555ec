"""The intervention API: registry, option checking, ordering, atomic multi-apply, handles, optimizer use."""

from __future__ import annotations

import pytest
import torch
import zoo

from stabkit.interventions import (
    ORDER,
    InterventionError,
    active_interventions,
    apply,
    describe_registry,
    option_defaults,
)
from stabkit.interventions.registry import plugin


def test_registry_lists_every_intervention_with_defaults() -> None:
    assert set(ORDER) == {
        "z_loss",
        "qk_clip",
        "qk_norm",
        "attn_softcap",
        "logit_softcap",
        "norm_placement",
        "rmsnorm",
        "router_fp32",
        "router_z_loss",
        "load_balance_loss",
        "aux_free_balance",
    }
    assert option_defaults(plugin("z_loss")) == {"coef": 1e-4}
    assert option_defaults(plugin("router_z_loss")) == {"coef": 1e-3}  # ST-MoE
    assert option_defaults(plugin("load_balance_loss")) == {"coef": 1e-2}  # Switch
    assert option_defaults(plugin("aux_free_balance")) == {"gamma": 1e-3}  # DeepSeek-V3
    assert option_defaults(plugin("attn_softcap")) == {"cap": 50.0}
    assert option_defaults(plugin("logit_softcap")) == {"cap": 30.0}
    assert option_defaults(plugin("qk_norm"))["kind"] == "rmsnorm"
    text = describe_registry()
    for name in ORDER:
        assert name in text and plugin(name).description in text
        assert all(f"{k}={v!r}" in text for k, v in option_defaults(plugin(name)).items())
    assert "to='sandwich' {pre|post|sandwich}" in text and "cap=50.0 (a number in (0, inf))" in text
    assert tuple(ORDER) == (
        "rmsnorm",
        "norm_placement",
        "qk_clip",
        "qk_norm",
        "attn_softcap",
        "logit_softcap",
        "z_loss",
        "router_fp32",
        "router_z_loss",
        "load_balance_loss",
        "aux_free_balance",
    )


def test_unknown_names_and_options_list_the_allowed_ones() -> None:
    model = zoo.reference_gpt()
    with pytest.raises(
        InterventionError, match=r"^qk-norm: unknown intervention; allowed: .*'qk_norm'.*'z_loss'"
    ):
        apply(model, "qk-norm")
    with pytest.raises(InterventionError, match=r"unknown option\(s\) \['capp'\].*cap \(default 50.0\)"):
        apply(model, "attn_softcap", capp=3)
    with pytest.raises(InterventionError, match=r"to must be one of \('pre', 'post', 'sandwich'\)"):
        apply(model, "norm_placement", to="middle")
    with pytest.raises(
        InterventionError, match=r"^logit_softcap: cap must be a number in \(0, inf\), got -1"
    ):
        apply(model, "logit_softcap", cap=-1)  # the range is the options field's metadata
    with pytest.raises(InterventionError, match=r"^z_loss: coef must be a number in \[0, inf\), got nan"):
        apply(model, "z_loss", coef=float("nan"))
    with pytest.raises(
        InterventionError, match=r"^qk_norm: eps must be a number in \(0, inf\) or \"none\", got 'small'"
    ):
        apply(model, "qk_norm", eps="small")
    with pytest.raises(InterventionError, match="pass options per entry"):
        apply(model, ["qk_norm"], cap=3)
    with pytest.raises(InterventionError, match="listed more than once"):
        apply(model, ["qk_norm", ("qk_norm", {"kind": "layernorm"})])
    assert isinstance(InterventionError("x", "y", "z"), ValueError)
    assert active_interventions(model) == {}


def test_multi_apply_orders_canonically_and_refuses_stacking() -> None:
    model = zoo.reference_gpt()
    handle = apply(model, ["z_loss", ("attn_softcap", {"cap": 5.0}), "rmsnorm", "qk_norm"])
    assert handle.names == [n for n in ORDER if n in ("z_loss", "attn_softcap", "rmsnorm", "qk_norm")]
    assert set(active_interventions(model)) == set(handle.names)
    with pytest.raises(InterventionError, match="already active"):
        apply(model, "qk_norm")
    handle.remove()
    assert active_interventions(model) == {}
    with apply(model, {"qk_norm": {"kind": "layernorm"}, "z_loss": {}}) as h:  # dict form, context manager
        assert h.names == ["qk_norm", "z_loss"]
    assert h.removed and active_interventions(model) == {}


def test_failed_multi_apply_rolls_back() -> None:
    torch.manual_seed(0)
    model = zoo.hf_llama()
    idx, _ = zoo.batch(0)
    base = model(idx).logits
    keys = list(model.state_dict())
    with pytest.raises(
        InterventionError, match=r"^rmsnorm: cannot apply to LlamaForCausalLM: no nn.LayerNorm"
    ):
        apply(model, ["qk_norm", "z_loss", "rmsnorm"])  # rmsnorm runs first and fails: nothing applied
    with pytest.raises(InterventionError, match="norm_placement"):
        apply(model, ["qk_norm", ("norm_placement", {"to": "pre"})])  # qk_norm runs after the failure
    with pytest.raises(InterventionError, match="attn_softcap"):
        model.config._attn_implementation = "flex_attention"
        apply(model, ["qk_norm", "attn_softcap", "z_loss"])  # qk_norm applied, then undone
    model.config._attn_implementation = "sdpa"
    assert list(model.state_dict()) == keys and active_interventions(model) == {}
    assert torch.equal(model(idx).logits, base)


def test_errors_name_intervention_module_and_what_is_missing() -> None:
    model = zoo.reference_gpt(qk_norm=True)
    with pytest.raises(InterventionError) as info:
        apply(model, "qk_norm")
    err = info.value
    assert (err.intervention, err.where) == ("qk_norm", "blocks.0.attn")
    assert "already has QK-norm" in err.missing and str(err).startswith(
        "qk_norm: cannot apply to blocks.0.attn:"
    )


def test_new_parameters_train_with_an_existing_optimizer() -> None:
    torch.manual_seed(0)
    model = zoo.reference_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = apply(model, ["qk_norm", ("norm_placement", {"to": "sandwich"})])
    new = handle.new_parameters()
    assert len(new) == 2 * 2 + 2 * 2  # q/k gains and two sandwich norms per block
    optimizer.add_param_group({"params": new})
    before = [p.detach().clone() for p in new]
    idx, tgt = zoo.batch(0)
    for _ in range(2):
        optimizer.zero_grad()
        zoo.lm_loss(model(idx), tgt).backward()
        optimizer.step()
    assert all(not torch.equal(p, b) for p, b in zip(new, before, strict=True))
    names = dict(model.named_parameters())
    assert "blocks.0.attn.q_norm.weight" in names and "blocks.1.post_norm2.weight" in names

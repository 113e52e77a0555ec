"""Interventions are the fourth plug-in family (`stabkit.plugins.INTERVENTIONS`): the built-ins are
listed by import path, and a plug-in registered after import is applied, ordered, option-checked,
verified, listed, named by the audit and switched on by the rescue like a built-in."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from zoo import reference_gpt

from stabkit.actions import ActionContext
from stabkit.actions.rescue import MIDRUN, Rescue, RescueOptions, midrun_fixes
from stabkit.audit import Finding, audit
from stabkit.cli.list_cmd import interventions_text
from stabkit.detect_config import DetectConfig
from stabkit.events import Event
from stabkit.interventions import (
    ORDER,
    Handle,
    Intervention,
    InterventionError,
    active_interventions,
    apply,
    choices,
    describe_registry,
)
from stabkit.interventions.base import option_choices, option_defaults
from stabkit.interventions.common import logits_map
from stabkit.interventions.registry import plugin
from stabkit.nonfinite.guard import KeptForward, rng_state
from stabkit.plugins import INTERVENTIONS
from stabkit.tables import bounds

BUILTINS = (
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


@dataclass(frozen=True)
class GainOptions:
    gain: float = field(default=0.5, metadata=bounds(lo=0.0, lo_open=True))
    mode: str = field(default="mul", metadata=choices("mul", "div"))

    def __post_init__(self) -> None:
        if self.mode == "div" and self.gain > 10:
            raise ValueError(f"gain must be <= 10 with mode 'div', got {self.gain}")


class Gain(Intervention):
    """Multiplies (or divides) the output logits by `gain`: at gain 1 the identity, so mid-run safe."""

    name = "test_gain"
    order = 45  # between attn_softcap (40) and logit_softcap (50)
    description = "multiply the output logits by a gain (a test plug-in)"
    options_class = GainOptions
    midrun = True
    midrun_preference = 1  # preferred over every built-in (qk_clip: 5)
    calls: ClassVar[list[str]] = []
    fail_verify = False

    def apply(self, model: nn.Module, model_map: Any, options: GainOptions) -> Handle:
        where = logits_map(model, self.name, model_map)
        handle = Handle(model, [self.name])
        factor = options.gain if options.mode == "mul" else 1 / options.gain

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            handle.count(where.path)
            return where.replace(output, where.take(output) * factor)

        handle.on_remove(model.get_submodule(where.path).register_forward_hook(hook).remove)
        self.calls.append(f"apply {options.gain:g}")
        return handle

    def verify(self, trace: Any, model: nn.Module, handle: Handle) -> None:
        self.calls.append("verify")
        if self.fail_verify or not handle.counts:
            raise InterventionError(self.name, type(model).__name__, "not in effect")

    def midrun_options(self, metrics: Mapping[str, float], margin: float) -> dict[str, Any]:
        self.calls.append(f"midrun_options {margin:g}")
        return {"gain": 1.0}

    def match_at_switch(self, model: nn.Module, handle: Handle, rerun: Callable[[], Any]) -> None:
        outputs = rerun()
        self.calls.append(f"match {len(outputs)}")


@pytest.fixture
def gain() -> Iterator[type[Gain]]:
    Gain.calls.clear()
    Gain.fail_verify = False
    INTERVENTIONS.register(Gain)  # after every stabkit module was imported
    try:
        yield Gain
    finally:
        INTERVENTIONS.unregister(Gain.name)


def model_and_batch() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return reference_gpt(vocab_size=256, context=32), torch.randint(0, 256, (2, 32))


@pytest.mark.multiprocess
def test_builtin_names_are_known_without_importing_torch() -> None:
    code = (
        "import sys; from stabkit.plugins import INTERVENTIONS as I; print(I.names(), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == f"{BUILTINS} False"


def test_builtins_are_plugins_in_the_old_order_with_the_old_midrun_fixes() -> None:
    assert INTERVENTIONS.names() == BUILTINS and tuple(ORDER) == BUILTINS
    for name in BUILTINS:
        cls = INTERVENTIONS.load(name)
        assert issubclass(cls, Intervention) and cls.name == name and cls.description
        assert INTERVENTIONS.describe(name).startswith("stabkit.interventions.")
    assert (
        midrun_fixes()
        == (
            "qk_clip",
            "qk_norm",
            "attn_softcap",
            "z_loss",
            "logit_softcap",
            "aux_free_balance",
            "router_z_loss",
            "router_fp32",
        )
        == tuple(MIDRUN)
    )
    assert RescueOptions().fixes == midrun_fixes()
    assert option_choices(plugin("qk_norm")) == {"kind": ("rmsnorm", "layernorm")}
    assert option_defaults(plugin("qk_norm")) == {"kind": "rmsnorm", "eps": None}


def test_a_plugin_registered_after_import_applies_like_a_builtin(gain: type[Gain]) -> None:
    model, x = model_and_batch()
    with torch.no_grad():
        before = model(x).clone()
    assert "test_gain" in ORDER and tuple(ORDER).index("test_gain") == 5  # its `order`, live
    assert option_defaults(plugin("test_gain")) == {"gain": 0.5, "mode": "mul"}
    for text in (describe_registry(), interventions_text()):
        assert "multiply the output logits by a gain" in text and "mode='mul' {mul|div}" in text
    handle = apply(model, ["z_loss", ("test_gain", {"gain": 0.25}), "qk_norm"])
    assert handle.names == ["qk_norm", "test_gain", "z_loss"]  # canonical order
    assert gain.calls == ["apply 0.25", "verify"]  # checked in effect on the apply-time forward
    assert set(active_interventions(model)) == {"qk_norm", "test_gain", "z_loss"}
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_plugin_options_are_checked_and_errors_name_the_intervention(gain: type[Gain]) -> None:
    model, _ = model_and_batch()
    cases = {
        "unknown option\\(s\\) \\['gian'\\]; allowed: gain \\(default 0.5\\), mode \\(default 'mul'\\)": {
            "gian": 2
        },
        "gain must be a number in \\(0, inf\\), got -1": {"gain": -1},
        "gain must be a number in \\(0, inf\\), got inf": {"gain": float("inf")},
        "mode must be one of \\('mul', 'div'\\), got 'add'": {"mode": "add"},
        "gain must be <= 10 with mode 'div', got 20": {"gain": 20, "mode": "div"},  # __post_init__
    }
    for message, options in cases.items():
        with pytest.raises(InterventionError, match=f"^test_gain: {message}"):
            apply(model, "test_gain", **options)
    assert gain.calls == [] and active_interventions(model) == {}


def test_a_plugin_not_in_effect_is_removed_and_named(gain: type[Gain]) -> None:
    model, x = model_and_batch()
    with torch.no_grad():
        before = model(x).clone()
    gain.fail_verify = True
    with pytest.raises(InterventionError, match="^test_gain: cannot apply to GPT: not in effect"):
        apply(model, ["qk_norm", "test_gain"])
    assert active_interventions(model) == {}
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_unknown_and_nameless_plugins() -> None:
    with pytest.raises(InterventionError, match="^test_gain: unknown intervention; allowed: .*'z_loss'"):
        apply(reference_gpt(), "test_gain")
    with pytest.raises(TypeError, match="needs a non-empty class attribute 'name'"):
        INTERVENTIONS.register(type("Nameless", (Intervention,), {}))


def test_the_audit_reads_the_registry_live(gain: type[Gain]) -> None:
    finding = Finding("r", "risk", ["lm_head"], {}, "why (practice)", ["test_gain(gain=0.5)", "lower the LR"])
    assert finding.interventions == [("test_gain", {"gain": "0.5"})]
    report = audit(reference_gpt(), active_interventions=["test_gain"])
    assert "test_gain" in report.inputs["active_interventions"]
    INTERVENTIONS.unregister("test_gain")
    assert finding.interventions == []
    with pytest.raises(ValueError, match="unknown active_interventions \\['test_gain'\\]"):
        audit(reference_gpt(), active_interventions=["test_gain"])


def test_the_rescue_switches_a_registered_midrun_plugin_on(gain: type[Gain]) -> None:
    assert midrun_fixes()[0] == "test_gain" and RescueOptions().fixes[0] == "test_gain"
    model, x = model_and_batch()
    with torch.no_grad():
        before = model(x).clone()
    kept = [KeptForward((x,), {}, *rng_state(), [])]
    reported: list[Event] = []
    cfg = DetectConfig(options={"rescue": {"cap_margin": 3.0}})
    ctx = ActionContext(
        model, None, cfg, forwards=lambda: kept, logdir=lambda: None, metrics=dict, report=reported.append
    )
    event = Event(
        5, "drift", "logits/logz_max", 1.0, 0.0, "m", details={"interventions": ["z_loss", "test_gain"]}
    )
    Rescue(ctx).run(event, before_update=False)
    record = event.details["rescue"]
    assert record["fix"] == "test_gain" and record["options"] == {"gain": 1.0}
    assert record["output_change"] == 0.0 and "test_gain" in active_interventions(model)
    assert gain.calls == ["midrun_options 3", "apply 1", "verify", "match 1"]
    with torch.no_grad():
        assert torch.equal(model(x), before)
    with pytest.raises(ValueError, match="fixes \\['norm_placement'\\] cannot go on mid-run; choose from"):
        RescueOptions(fixes=("norm_placement",))
    assert DetectConfig(options={"rescue": {"fixes": ["test_gain"]}}).options_for("rescue").fixes == (
        "test_gain",
    )

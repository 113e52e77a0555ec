"""The plug-in registries: names known without importing plug-in code, clear errors, and a user
plug-in of each family working end to end through `attach`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping

import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.actions import Action
from stabkit.detectors import Advice, DetectConfig, Detector, Observation
from stabkit.events import Event, InstabilityError
from stabkit.plugins import ACTIONS, DETECTORS, PROBES, Registry


@pytest.mark.multiprocess
def test_configs_know_plugin_names_without_importing_torch_or_plugins() -> None:
    code = (
        "import sys; from stabkit.detect_config import DetectConfig; "
        "from stabkit.plugins import DETECTORS; "
        "c = DetectConfig(actions={'attn_entropy': 'raise', 'spike': ['dump', 'skip']}, act_on='info'); "
        "print(tuple(c.actions) == DETECTORS.names(), "
        "'torch' in sys.modules, 'stabkit.detectors.spike' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False", "False"]


def test_registry_errors_name_the_problem() -> None:
    reg: Registry[type] = Registry("thing", {"a": "json:dumps"}, "name")
    assert reg.names() == ("a",) and reg.load("a") is __import__("json").dumps
    with pytest.raises(KeyError, match="no thing named 'b'; registered: a"):
        reg.load("b")

    class Nameless:
        name = ""

    with pytest.raises(TypeError, match="non-empty class attribute 'name'"):
        reg.register(Nameless)

    class One:
        name = "x"

    class Two:
        name = "x"

    reg.register(One)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(Two)
    reg.register(One)  # the same class again (a re-imported module) is fine
    with pytest.raises(ValueError, match="unknown kind"):
        DetectConfig(actions={"no_such_kind": "warn"})
    with pytest.raises(ValueError, match="one of .*'rollback'"):
        DetectConfig(actions={"spike": "no_such_action"})
    with pytest.raises(ValueError, match="unknown detector"):
        DetectConfig(detectors=("spike", "nope"))


class LossAbove(Detector):
    """A user's detector: an event when the loss is above 100 (decided from plain values)."""

    kind = "loss_above"
    watches = ("loss",)
    advice = {"big_loss": Advice("loss above 100", (), "look at the data")}  # noqa: RUF012

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        x = values["loss"]
        return Observation([Event(step, self.kind, "loss", x, 100.0, "big")] if x > 100 else [])


class Count(Action):
    """A user's action: counts the events it saw, before the report."""

    name = "count"
    order = 10
    seen: list[int] = []  # noqa: RUF012

    def run(self, event: Event, before_update: bool) -> bool:
        Count.seen.append(event.step)
        event.details["counted"] = True
        return before_update  # skip the update when still possible


@pytest.fixture
def user_plugins() -> object:
    DETECTORS.register(LossAbove)
    ACTIONS.register(Count)
    Count.seen = []
    yield
    DETECTORS.unregister("loss_above")
    ACTIONS.unregister("count")


@pytest.mark.parametrize("per_step", [False, True])
def test_a_user_detector_and_action_run_through_attach(user_plugins: object, per_step: bool) -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    actions = ["count", "raise"] if per_step else ["warn"]
    cfg = stabkit.MonitorConfig(
        console=False, log_every=4, detect=DetectConfig(actions={"loss_above": actions})
    )
    mon = stabkit.attach(model, opt, config=cfg)
    x = torch.randint(0, 64, (2, 8))
    raised = None
    for step in range(8):
        loss = model(x).float().mean() * 0 + (500.0 if step == 5 else 1.0)
        opt.step()
        try:
            mon.step(loss)
        except InstabilityError as exc:
            raised = exc
    mon.detach()
    mine = [e for e in mon.events if e.kind == "loss_above"]
    assert [e.step for e in mine] == [5] and mine[0].details["advice"] == "big_loss"
    assert mine[0].advice == "look at the data"
    if per_step:  # decided at Monitor.step 5 (the loss is known only then): counted, reported, raised
        assert Count.seen == [5] and mine[0].details["counted"] and raised is not None
        assert raised.event is mine[0]
    else:  # decided from the host rows at the log interval (step 7 flushes steps 4..7)
        assert Count.seen == [] and raised is None


def test_probes_are_built_from_the_registry_by_family() -> None:
    model = reference_gpt()
    cfg = stabkit.MonitorConfig(console=False, families=frozenset({"grad", "loss"}), detect=None)
    with stabkit.attach(model, config=cfg) as mon:
        assert [p.name for p in mon.probes] == ["grad"]
    full = stabkit.attach(model, config=stabkit.MonitorConfig(console=False, detect=None))
    assert [p.name for p in full.probes] == [
        n for n in PROBES.names() if n in ("act", "logits", "grad", "attn", "outliers", "moe")
    ]
    full.detach()

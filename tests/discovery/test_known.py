"""Discovery traces once per model while it is unchanged, and what it keeps lives on the model."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn
from zoo import reference_gpt

import stabkit
import stabkit.discovery.discover as discover
from stabkit.discovery.known import ATTR, Discovery


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every traced forward, by the class of the module traced."""
    seen: list[str] = []
    real = discover.run_trace

    def counting(module: nn.Module, *a: object, **k: object) -> object:
        seen.append(type(module).__name__)
        return real(module, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(discover, "run_trace", counting)
    return seen


def test_attach_then_inspect_trace_once(traces: list[str]) -> None:
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters())
    with stabkit.attach(model, opt) as mon:
        assert len(traces) == 1
        again = stabkit.inspect_model(model)
        stabkit.audit(model, opt)
    assert len(traces) == 1
    assert again.describe() == mon.model_map.describe()


def test_an_intervention_retraces_the_changed_model_once(traces: list[str]) -> None:
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters())
    with stabkit.attach(model, opt, interventions=["qk_norm"]) as mon:
        # the model as given, then the model with QK-norm (its map shows the new norms)
        assert len(traces) == 2
        assert all(a.qk_norm for a in mon.model_map.attentions)
    model2 = reference_gpt()
    stabkit.inspect_model(model2)
    assert len(traces) == 3


def test_a_copy_or_pickle_of_the_model_starts_knowing_nothing() -> None:
    model = reference_gpt()
    stabkit.inspect_model(model)
    known = Discovery.of(model)
    assert known.traced(model) is not None and known.example is not None
    twin = copy.deepcopy(model)
    assert Discovery.of(twin) is not known
    assert Discovery.of(twin).traced(twin) is None and Discovery.of(twin).example is None
    back = pickle.loads(pickle.dumps(model))
    assert isinstance(back.__dict__[ATTR], Discovery) and back.__dict__[ATTR].example is None
    # nothing of it reaches the weights
    assert not any(ATTR in k for k in model.state_dict())


def test_a_gap_is_said_once_while_the_model_is_unchanged() -> None:
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))  # no attention anywhere
    said = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stabkit.attach(model).detach()
        said += [w for w in caught if "no attention call stabkit can read" in str(w.message)]
    assert len(said) == 1
    model.eval()  # a changed model is told again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stabkit.attach(model).detach()
    assert [w for w in caught if "no attention call stabkit can read" in str(w.message)]

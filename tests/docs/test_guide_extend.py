"""The guide's "Extend stabkit" page (docs/guide/extend.md) runs as written: its probe, detector and action plug in
and work on a real training loop (a fault makes the detector fire; the action saves a checkpoint);
its intervention applies, is checked, ordered, listed and removed like a built-in."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.config import DEFAULT_FAMILIES
from stabkit.interventions import ORDER, InterventionError, active_interventions, apply, describe_registry
from stabkit.plugins import ACTIONS, DETECTORS, INTERVENTIONS, PROBE_FAMILIES, PROBES

from ..detectors.helpers import text_batches, train_with_logit_fault

PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "extend.md"
"""The guide page (the README's section before the docs site)."""


def section_code() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.fixture
def plugins() -> Iterator[dict[str, Any]]:
    namespace: dict[str, Any] = {}
    try:
        for block in section_code():
            exec(compile(block, str(PAGE), "exec"), namespace)
        yield namespace
    finally:
        PROBES.unregister("emb")
        PROBE_FAMILIES.discard("emb")
        DETECTORS.unregister("my_entropy")
        ACTIONS.unregister("checkpoint")
        INTERVENTIONS.unregister("scale_logits")


def test_the_section_holds_a_probe_a_detector_a_row_test_an_action_and_an_intervention() -> None:
    blocks = section_code()
    assert len(blocks) == 5
    assert "@PROBES.register" in blocks[0] and "@DETECTORS.register" in blocks[1]
    assert "Judge(" in blocks[2] and "@ACTIONS.register" in blocks[3]
    assert "@INTERVENTIONS.register" in blocks[4]


def test_readme_plugins_work_on_a_training_loop(plugins: dict[str, Any], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detect = stabkit.DetectConfig(actions={"my_entropy": ["warn", "checkpoint"]})
    cfg = stabkit.MonitorConfig(
        console=False, every=5, log_every=20, families=DEFAULT_FAMILIES | {"emb"}, detect=detect
    )
    mon = stabkit.attach(model, opt, logdir=tmp_path, config=cfg)
    assert "emb: forward hook on Embedding" in mon.describe_hooks()
    first, _ = next(text_batches(1, 8, 32, seed=0))  # the loop's first batch
    with torch.no_grad():  # by hand: the RMS of the token embedding of the first batch, initial weights
        expected = model.tok_emb(first).pow(2).mean().sqrt().item()
    train_with_logit_fault(model, opt, mon, steps=100, fault_at=60)
    mon.detach()
    rows = dict(mon.history)
    assert rows[0]["emb/tok_emb/rms"] == pytest.approx(expected, rel=1e-6)
    assert all("emb/tok_emb/rms" in rows[s] for s in range(0, 100, 5))
    assert "emb/tok_emb/rms" not in rows[1]  # sampled steps only
    mine = [e for e in mon.events if e.kind == "my_entropy"]
    assert [e.where for e in mine] == ["attn/blocks.1.attn/min_head_entropy"]
    assert 60 <= mine[0].step <= 75 and mine[0].details["advice"] == "collapse"
    saved = Path(mine[0].details["checkpoint"])
    assert saved.exists() and set(torch.load(saved)) == set(model.state_dict())


def test_readme_intervention_applies_like_a_builtin(plugins: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    x, _ = next(text_batches(1, 2, 32, seed=0))
    with torch.no_grad():
        before = model(x).clone()
    order = tuple(ORDER)
    at = order.index("scale_logits")  # its `order` (55), live: after logit_softcap (50), before z_loss (60)
    assert order[at - 1 : at + 2] == ("logit_softcap", "scale_logits", "z_loss")
    assert (
        "scale_logits" in describe_registry() and "factor=0.5 (a number in (0, inf))" in describe_registry()
    )
    with apply(model, "scale_logits", factor=0.25) as handle:  # checked in effect on a traced forward
        assert handle.counts and set(active_interventions(model)) == {"scale_logits"}
        with torch.no_grad():
            assert torch.equal(model(x), before * 0.25)
    with torch.no_grad():
        assert torch.equal(model(x), before)  # removed: exactly as before
    with pytest.raises(
        InterventionError, match=r"^scale_logits: factor must be a number in \(0, inf\), got 0"
    ):
        apply(model, "scale_logits", factor=0)
    with pytest.raises(InterventionError, match=r"^scale_logits: unknown option\(s\) \['scale'\]"):
        apply(model, "scale_logits", scale=2)
    both = apply(model, ["z_loss", "scale_logits"])  # canonical order, whatever the listed order
    assert both.names == ["scale_logits", "z_loss"]
    both.remove()


def test_readme_intervention_verify_refuses_a_model_it_cannot_reach(plugins: dict[str, Any]) -> None:
    cls = plugins["ScaleLogits"]
    model = reference_gpt(vocab_size=256, context=32)
    handle = cls().apply(model, None, cls.options_class())
    handle.counts.clear()  # as after a forward that never reached the head
    with pytest.raises(InterventionError, match="scale_logits: cannot apply to GPT: not in effect"):
        cls().verify(None, model, handle)
    handle.remove()

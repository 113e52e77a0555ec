"""The attention-entropy-collapse detector: from plain rows (no model) and on a real model with an
injected fault (q and k weights of one block scaled ×10 mid-run: its attention turns one-hot)."""

from __future__ import annotations

import json

import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.detectors import DetectConfig, DetectorContext, EntropyCollapseDetector, Judge

from .helpers import train_with_logit_fault

SERIES = "attn/blocks.1.attn/min_head_entropy"


def judge(**options: float) -> Judge:
    cfg = DetectConfig(options={"attn_entropy": dict(options)} if options else {})
    return Judge(DetectorContext(cfg, attention_paths=("blocks.0.attn", "blocks.1.attn")))


def feed(j: Judge, values: list[float], every: int = 5) -> list[stabkit.Event]:
    rows = [(i * every, {SERIES: v, "loss": 2.0}) for i, v in enumerate(values)]
    return [e for e in j.rows(rows) if e.kind == "attn_entropy"]


def test_a_fast_fall_that_stays_low_is_one_event_at_the_third_low_value() -> None:
    values = [2.3] * 20 + [0.05] * 10
    events = feed(judge(), values)
    assert len(events) == 1
    e = events[0]
    assert e.step == (20 + 2) * 5  # persist = 3: the third value at or below 0.3 nats
    assert e.where == "blocks.1.attn" and e.value == pytest.approx(0.05) and e.threshold == 0.3
    assert e.details["high"] == pytest.approx(2.3)
    assert e.details["advice"] == "attn_entropy_collapse"
    assert e.details["interventions"] == ["qk_clip", "qk_norm", "attn_softcap"]


def test_slow_sharpening_a_blip_and_a_never_healthy_head_are_not_collapse() -> None:
    slow = [2.3 - 2.25 * i / 200 for i in range(201)] + [0.05] * 10  # a head learning a sharp pattern
    assert feed(judge(), slow) == []
    blip = [2.3] * 20 + [0.05, 0.05] + [2.3] * 10  # two low values, then back
    assert feed(judge(), blip) == []
    never = [0.8] * 10 + [0.05] * 10  # never stood at `healthy` (1 nat)
    assert feed(judge(), never) == []


def test_it_rearms_after_recovery_and_options_change_the_rule() -> None:
    twice = [2.3] * 12 + [0.05] * 5 + [2.3] * 12 + [0.05] * 5
    assert [e.step for e in feed(judge(), twice)] == [14 * 5, 31 * 5]
    assert feed(judge(persist=6), [2.3] * 12 + [0.05] * 5) == []  # not low for long enough
    assert len(feed(judge(low=0.6, healthy=2.0), [2.3] * 12 + [0.5] * 5)) == 1


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"drop": 2.0}, r"drop: must be a number in \(0, 1\)"),
        ({"window": 0}, "window: must be an integer >= 1"),
        ({"lo": 1}, "unknown key"),
        ({"low": 2.0}, "need low < healthy"),
    ],
)
def test_bad_options_name_the_detector(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        judge(**options)
    assert "DetectConfig.options.attn_entropy" in str(info.value)


def test_state_round_trips() -> None:
    values = [2.3] * 12 + [0.05] * 2
    a = judge()
    feed(a, values)
    det = a["attn_entropy"]
    assert isinstance(det, EntropyCollapseDetector)
    b = judge()
    b["attn_entropy"].load_state_dict(json.loads(json.dumps(det.state_dict())))
    later = [(len(values) * 5, {SERIES: 0.05})]
    assert [e.step for e in a.rows(list(later))] == [e.step for e in b.rows(list(later))] == [70]


def train(fault_at: int | None, steps: int = 160) -> stabkit.Monitor:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    cfg = stabkit.MonitorConfig(console=False, every=5, log_every=50)
    mon = stabkit.attach(model, opt, config=cfg)
    train_with_logit_fault(model, opt, mon, steps, fault_at)
    mon.detach()
    return mon


def test_injected_logit_blowup_is_found_in_that_block_and_a_clean_run_has_none() -> None:
    faulty = [e for e in train(fault_at=100).events if e.kind == "attn_entropy"]
    assert [e.where for e in faulty] == ["blocks.1.attn"]
    assert 100 <= faulty[0].step <= 115  # three sampled steps (every=5) after the fault
    assert faulty[0].value <= 0.3 < 1.0 <= faulty[0].details["high"]
    assert [e for e in train(fault_at=None).events if e.kind == "attn_entropy"] == []


def test_rows_whose_names_change_from_step_to_step_are_judged_alike() -> None:
    values = [2.3] * 20 + [0.05] * 10
    expected = [(e.step, e.value) for e in feed(judge(), values)]
    rows: list[tuple[int, dict[str, float]]] = []
    for i, v in enumerate(values):  # the judge remembers each detector's names per set of names
        row = {"loss": 2.0, SERIES: v} if i % 2 else {SERIES: v, "loss": 2.0}
        if i % 3 == 0:
            row["grad/global_norm"] = 1.0
        rows.append((i * 5, row))
    assert (
        expected and [(e.step, e.value) for e in judge().rows(rows) if e.kind == "attn_entropy"] == expected
    )

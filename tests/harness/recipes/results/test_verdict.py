"""Verdict logic, LR sensitivity, and the measures, against hand computations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from stabkit.harness.data import load_corpus
from stabkit.harness.recipes.results.measures import aggregate, best_smoothed, bigram_loss, tail_mean
from stabkit.harness.recipes.results.verdict import (
    FIXED,
    NO_RESCUE,
    NOT_AT_SIZE,
    NOT_FIXED,
    NOT_REPRODUCED,
    NOT_RESCUED,
    REPRODUCED,
    RESCUED,
    Verdict,
    judge,
)
from stabkit.harness.recipes.run.faults import FaultyCorpus
from stabkit.harness.recipes.science.sweep import lr_sensitivity
from stabkit.harness.recipes.spec.checks import Check
from stabkit.harness.recipes.spec.schema import FaultSpec

ROLES = {"baseline": "baseline", "qk": "intervention", "cap": "intervention", "ref": "reference"}
ORDER = list(ROLES)
REPRO = [Check("max_attn_logit", ">", 1e3), Check("val_loss", ">", 0.25, vs="reference")]
FIX = {"qk": [Check("max_attn_logit", "<", 100)], "cap": [Check("val_loss", "<", -0.1, vs="baseline")]}


def result(**values: float) -> dict[str, object]:
    return {"status": "done", **values}


def test_reproduced_and_fixed() -> None:
    results = {
        "baseline": result(max_attn_logit=2e4, val_loss=2.6),
        "qk": result(max_attn_logit=15.0, val_loss=2.27),
        "cap": result(max_attn_logit=9e3, val_loss=2.55),  # only 0.05 better than the baseline
        "ref": result(max_attn_logit=25.0, val_loss=2.13),
    }
    v = judge(ORDER, ROLES, results, REPRO, FIX, {})
    assert v["baseline"].verdict == REPRODUCED
    assert v["baseline"].checks[1].measured == pytest.approx(2.6 - 2.13)
    assert v["qk"].verdict == FIXED
    assert v["cap"].verdict == NOT_FIXED and v["cap"].checks[0].measured == pytest.approx(-0.05)
    assert v["ref"].verdict == "reference"


def test_an_intervention_is_never_fixed_when_the_baseline_did_not_reproduce() -> None:
    results = {
        "baseline": result(max_attn_logit=500.0, val_loss=2.6),  # logits below 1e3: not reproduced
        "qk": result(max_attn_logit=15.0, val_loss=2.27),
        "ref": result(max_attn_logit=25.0, val_loss=2.13),
    }
    v = judge(ORDER, ROLES, results, REPRO, FIX, {"qk": [Check("max_attn_logit", "<", 100)]})
    assert v["baseline"].verdict == NOT_REPRODUCED
    assert v["qk"].verdict == NOT_AT_SIZE
    assert v["qk"].checks[0].passed and v["qk"].mechanism[0].passed  # still shown


def test_missing_numbers_and_failed_runs_are_undetermined_not_guessed() -> None:
    results = {
        "baseline": result(val_loss=2.6),  # no attention metric measured
        "qk": {"status": "failed", "error": "boom"},
        "ref": result(val_loss=2.13),
    }
    v = judge(ORDER, ROLES, results, REPRO, FIX, {})
    assert v["baseline"].verdict == "undetermined" and v["baseline"].checks[0].passed is None
    assert v["qk"].verdict == "failed"
    nan_base = {**results, "baseline": result(max_attn_logit=math.nan, val_loss=math.nan)}
    assert judge(ORDER, ROLES, nan_base, REPRO, FIX, {})["baseline"].verdict == "undetermined"


def test_vs_best_and_ratio() -> None:
    roles = {"baseline": "baseline", "a": "intervention"}
    results = {"baseline": result(lr_sensitivity_high=0.33), "a": result(lr_sensitivity_high=0.09)}
    ratio = Check("lr_sensitivity_high", "<=", 0.5, vs="baseline", how="ratio")
    best = Check("lr_sensitivity_high", ">", 0.2, vs="best")
    v = judge(["baseline", "a"], roles, results, [best], {"a": [ratio]}, {})
    assert (
        v["baseline"].checks[0].measured == pytest.approx(0.33 - 0.09) and v["baseline"].verdict == REPRODUCED
    )
    assert v["a"].checks[0].measured == pytest.approx(0.09 / 0.33) and v["a"].verdict == FIXED


def test_event_counts_default_to_zero_only_for_finished_runs() -> None:
    roles = {"baseline": "baseline"}
    check = Check("events/nonfinite", ">=", 1)
    v = judge(["baseline"], roles, {"baseline": result()}, [check], {}, {})
    assert v["baseline"].checks[0].measured == 0 and v["baseline"].verdict == NOT_REPRODUCED


def test_lr_sensitivity_by_hand() -> None:
    losses = {3e-4: 2.8, 1e-3: 2.4, 1e-2: 2.2, 1e-1: 2.7, 3e-1: math.nan}
    init, best = 5.5, 2.1
    whole = ((2.8 - best) + (2.4 - best) + (2.2 - best) + (2.7 - best) + (init - best)) / 5
    assert lr_sensitivity(losses, init, best) == pytest.approx(whole)
    high = ((2.2 - best) + (2.7 - best) + (init - best)) / 3  # NaN counts as the loss at init
    assert lr_sensitivity(losses, init, best, 1e-2, 3e-1) == pytest.approx(high)
    assert lr_sensitivity({1e-1: 9.0}, init, best) == pytest.approx(init - best)  # capped at l0
    assert math.isnan(lr_sensitivity(losses, init, best, 1.0, 2.0))


def test_aggregate_and_loss_summaries() -> None:
    history = [
        (0, {"attn/blocks.0.attn/max_logit": 3.0, "attn/blocks.1.attn/max_logit": 5.0, "loss": 4.0}),
        (5, {"attn/blocks.0.attn/max_logit": 9.0, "attn/blocks.1.attn/max_logit": math.nan}),
    ]
    assert aggregate(history, "attn/*/max_logit", "max") == (9.0, "attn/blocks.0.attn/max_logit")
    assert aggregate(history, "attn/*/max_logit", "min") == (3.0, "attn/blocks.0.attn/max_logit")
    assert aggregate(history, "attn/*/max_logit", "mean")[0] == pytest.approx((3 + 5 + 9) / 3)
    assert math.isnan(aggregate(history, "attn/blocks.1.attn/max_logit", "last")[0])
    assert aggregate(history, "attn/blocks.1.attn/max_logit", "first")[0] == 5.0
    assert math.isnan(aggregate(history, "nothing/*", "max")[0])
    losses = [float(v) for v in range(40, 0, -1)]  # 40 .. 1
    assert tail_mean(losses) == pytest.approx((4 + 3 + 2 + 1) / 4)
    assert best_smoothed(losses) == pytest.approx((2 + 1) / 2)  # window 40 // 20 = 2
    assert best_smoothed([5.0, math.nan, 3.0, 1.0]) == 1.0


def test_bigram_loss_by_hand(tmp_path: Path) -> None:
    text = tmp_path / "ab.txt"
    text.write_bytes(b"ab" * 1000)  # train: a->b and b->a only; the held-out part too
    corpus = load_corpus(text)
    n_ab = sum(1 for i in range(len(corpus.train) - 1) if corpus.train[i] == 97)
    n_ba = len(corpus.train) - 1 - n_ab
    p_ab = (n_ab + 0.1) / (n_ab + 0.1 * 256)
    p_ba = (n_ba + 0.1) / (n_ba + 0.1 * 256)
    val = corpus.val.tolist()
    expected = -sum(math.log(p_ab if a == 97 else p_ba) for a in val[:-1]) / (len(val) - 1)
    assert bigram_loss(str(text)) == pytest.approx(expected)
    assert bigram_loss(None) == pytest.approx(2.317, abs=5e-3)  # the proxy's reference level


def test_faulty_corpus_replaces_only_the_fault_steps_and_keeps_the_data_order() -> None:
    corpus = load_corpus()
    fault = FaultSpec("bad_batch", step=2, length=2)
    faulty = FaultyCorpus(corpus, fault, grad_accum=1, seed=0)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for step in range(6):
        clean = corpus.batch("train", 4, 16, g1)
        bad = faulty.batch("train", 4, 16, g2)
        same = torch.equal(clean[0], bad[0]) and torch.equal(clean[1], bad[1])
        assert same == (step not in (2, 3)), step
        assert torch.equal(bad[0][:, 1:], bad[1][:, :-1])  # still input/target windows


# ---- rescue variants: judged against the variant that had the fix from the start

RESCUE_ROLES = {"baseline": "baseline", "qk": "intervention", "cap": "intervention", "rescue": "rescue"}
RESCUE_ORDER = list(RESCUE_ROLES)


def rescue_results(rescue: dict[str, object]) -> dict[str, dict[str, object]]:
    return {
        "baseline": result(max_attn_logit=2e4, val_loss=2.6),
        "qk": {
            **result(max_attn_logit=15.0, val_loss=2.27),
            "interventions": {"qk_norm": {"kind": "layernorm"}},
        },
        "cap": {**result(val_loss=2.37), "interventions": {"attn_softcap": {"cap": 30.0}}},
        "rescue": {"interventions": {}, **rescue},
    }


def rescued_at(step: int, fix: str, lost: int, val: float, **extra: object) -> dict[str, object]:
    rescues = [
        {"step": step, "fix": fix, "restored_step": step - lost, "steps_lost": lost, "output_change": 0.03}
    ]
    return {
        **result(val_loss=val),
        "rescues": rescues,
        "rescue_count": 1,
        "rescue_fixes": [fix],
        "rescue_step": step,
        "steps_lost": lost,
        "rescue_failed": None,
        **extra,
    }


def judge_rescue_variant(rescue: dict[str, object], tolerance: float = 0.1) -> Verdict:
    fixes = {"qk": [Check("max_attn_logit", "<", 100)], "cap": [], "rescue": []}
    verdicts = judge(
        RESCUE_ORDER, RESCUE_ROLES, rescue_results(rescue), REPRO[:1], fixes, {}, {"rescue": tolerance}
    )
    return verdicts["rescue"]


def test_a_rescue_within_the_tolerance_of_the_fix_from_the_start_is_rescued() -> None:
    v = judge_rescue_variant(rescued_at(95, "qk_norm", 20, 2.33))
    assert v.verdict == RESCUED and v.role == "rescue"
    assert v.checks[0].measured == pytest.approx(2.33 - 2.27) and v.checks[0].passed
    assert v.rescue is not None and v.rescue["compared_with"] == "qk" and v.rescue["steps_lost"] == 20
    assert v.rescue["fixes"] == ["qk_norm"] and v.rescue["step"] == 95 and v.rescue["restored_steps"] == [75]
    assert "rescue" in v.to_dict() and "rescue" not in judge_rescue_variant_baseline().to_dict()


def judge_rescue_variant_baseline() -> Verdict:
    fixes: dict[str, list[Check]] = {"qk": [], "cap": [], "rescue": []}
    return judge(RESCUE_ORDER, RESCUE_ROLES, rescue_results({}), REPRO[:1], fixes, {})["baseline"]


def test_a_rescue_beyond_the_tolerance_is_not_rescued_and_says_by_how_much() -> None:
    v = judge_rescue_variant(rescued_at(95, "attn_softcap", 45, 2.52))
    assert v.verdict == NOT_RESCUED and v.rescue is not None and v.rescue["compared_with"] == "cap"
    assert v.checks[0].measured == pytest.approx(2.52 - 2.37) and v.checks[0].passed is False
    assert judge_rescue_variant(rescued_at(95, "qk_norm", 20, 2.33), tolerance=0.05).verdict == NOT_RESCUED
    diverged = judge_rescue_variant(rescued_at(95, "qk_norm", 20, math.nan))
    assert diverged.verdict == NOT_RESCUED and diverged.checks[0].measured == math.inf


def test_no_rescue_failed_rescue_and_no_comparison_variant() -> None:
    quiet = {**result(val_loss=2.6), "rescues": [], "rescue_count": 0, "rescue_fixes": [], "steps_lost": 0}
    assert judge_rescue_variant(quiet).verdict == NO_RESCUE
    failed = {
        **rescued_at(95, "qk_norm", 20, 2.5),
        "status": "stopped",
        "stopped": {"step": 180, "kind": "drift", "message": "m"},
        "rescue_failed": {"step": 180, "message": "rescue failed: ..."},
    }
    v = judge_rescue_variant(failed)
    assert v.verdict == "rescue failed at step 180" and v.rescue is not None and v.rescue["failed_at"] == 180
    z = judge_rescue_variant(rescued_at(95, "z_loss", 10, 2.3))
    assert z.verdict == "not judged: no z_loss variant to compare with" and z.checks == []
    unfinished = rescue_results(rescued_at(95, "qk_norm", 20, 2.3))
    unfinished["qk"]["status"] = "failed"
    v = judge(RESCUE_ORDER, RESCUE_ROLES, unfinished, REPRO[:1], {}, {})["rescue"]
    assert v.verdict == "not judged: the qk variant failed"


def test_a_variant_stopped_by_stabkit_says_where() -> None:
    results = {"baseline": {"status": "stopped", "stopped": {"step": 42, "kind": "drift", "message": "m"}}}
    assert judge(["baseline"], {"baseline": "baseline"}, results, REPRO, {}, {})["baseline"].verdict == (
        "stopped at step 42"
    )

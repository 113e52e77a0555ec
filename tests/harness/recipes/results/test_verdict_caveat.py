"""Verdicts that agree with the variant's own checks, and a results table that cannot say both
"diverged yes" and "fixed" — on hand-made results shaped like attention-logit-growth's seed 2 (QK-Clip
within 0.2 of the reference, but a clipped head at 64.2 against its mechanism check's 45)."""

from __future__ import annotations

import itertools
import re

import pytest

from stabkit.harness.recipes.results.report import footer, results_table, verdict_lines
from stabkit.harness.recipes.results.summary import Summary
from stabkit.harness.recipes.results.verdict import (
    CAVEAT_LEGEND,
    FIXED,
    FIXED_CAVEAT,
    NOT_FIXED,
    RESCUED,
    RESCUED_CAVEAT,
    judge,
)
from stabkit.harness.recipes.spec.checks import Check

BIGRAM = 2.317
ROLES = {"baseline": "baseline", "qk_clip": "intervention", "reference": "reference"}
ORDER = list(ROLES)
REPRODUCED = [Check("max_attn_logit", ">", 1e3), Check("val_loss", ">", 0.25, vs="reference")]
FIXED_CHECKS = {
    "qk_clip": [Check("val_loss", "<", -0.1, vs="baseline"), Check("val_loss", "<", 0.2, vs="reference")]
}
MECHANISM = {"qk_clip": [Check("qk_clip_max_after_clip", "<=", 45.0)]}


def done(val: float, **values: float) -> dict[str, object]:
    """A finished variant's result, with `diverged` as the worker computes it (bigram level 2.317)."""
    return {
        "status": "done",
        "val_loss": val,
        "bigram_loss": BIGRAM,
        "diverged": float(val >= BIGRAM),
        **values,
    }


def results(clip_val: float, after_clip: float | None) -> dict[str, dict[str, object]]:
    clip = done(clip_val, max_attn_logit=64.2)
    if after_clip is not None:
        clip["qk_clip_max_after_clip"] = after_clip
    return {
        "baseline": done(2.594, max_attn_logit=2.1e4),
        "qk_clip": clip,
        "reference": done(2.135, max_attn_logit=27.8),
    }


def test_fixed_checks_passing_with_a_failing_mechanism_check_is_fixed_star_not_fixed() -> None:
    v = judge(ORDER, ROLES, results(2.332, 64.2), REPRODUCED, FIXED_CHECKS, MECHANISM)
    clip = v["qk_clip"]
    assert [c.passed for c in clip.checks] == [True, True]  # 2.332 − 2.594 = −0.262, 2.332 − 2.135 = 0.197
    assert clip.mechanism[0].measured == pytest.approx(64.2) and clip.mechanism[0].passed is False
    assert clip.verdict == FIXED_CAVEAT == "fixed*"
    # the same variant whose clip held (<= 45) is plainly fixed
    assert (
        judge(ORDER, ROLES, results(2.332, 41.0), REPRODUCED, FIXED_CHECKS, MECHANISM)["qk_clip"].verdict
        == FIXED
    )
    # a mechanism that could not be measured (no head ever clipped) is a caveat too
    missing = judge(ORDER, ROLES, results(2.332, None), REPRODUCED, FIXED_CHECKS, MECHANISM)["qk_clip"]
    assert missing.mechanism[0].passed is None and missing.verdict == FIXED_CAVEAT


def test_fixed_exactly_when_every_own_check_passes() -> None:
    """Over pass/fail of the loss checks and of the mechanism check: "fixed" only when all pass,
    "fixed*" when only the mechanism fails, "not fixed" whenever a fixed check fails."""
    for clip_val, after in itertools.product((2.30, 2.36, 2.52), (40.0, 64.2)):
        loss_ok = clip_val - 2.594 < -0.1 and clip_val - 2.135 < 0.2  # by hand: only 2.30 passes both
        mech_ok = after <= 45.0
        v = judge(ORDER, ROLES, results(clip_val, after), REPRODUCED, FIXED_CHECKS, MECHANISM)["qk_clip"]
        expected = (FIXED if mech_ok else FIXED_CAVEAT) if loss_ok else NOT_FIXED
        assert v.verdict == expected, (clip_val, after)
    assert [x for x in (2.30, 2.36, 2.52) if x - 2.594 < -0.1 and x - 2.135 < 0.2] == [2.30]


def test_a_rescue_with_a_failing_mechanism_check_is_rescued_star() -> None:
    roles = {**ROLES, "rescue": "rescue"}
    res = results(2.30, 41.0)
    res["qk_clip"]["interventions"] = {"qk_clip": {"tau": 30.0}}
    res["rescue"] = {
        **done(2.34, qk_clip_max_after_clip=63.6),
        "interventions": {},
        "rescues": [{"step": 25, "fix": "qk_clip", "restored_step": 0, "steps_lost": 25}],
        "rescue_count": 1,
        "rescue_fixes": ["qk_clip"],
        "rescue_failed": None,
    }
    mech = {**MECHANISM, "rescue": MECHANISM["qk_clip"]}
    v = judge([*ORDER, "rescue"], roles, res, REPRODUCED, FIXED_CHECKS, mech, {"rescue": 0.1})
    assert v["rescue"].checks[0].passed and v["rescue"].verdict == RESCUED_CAVEAT == RESCUED + "*"
    held = {**res, "rescue": {**res["rescue"], "qk_clip_max_after_clip": 44.0}}
    assert (
        judge([*ORDER, "rescue"], roles, held, REPRODUCED, FIXED_CHECKS, mech, {"rescue": 0.1})[
            "rescue"
        ].verdict
        == RESCUED
    )


def columns(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The results table parsed back: its header cells and, per variant, cell by header (cells are
    split on two or more spaces, as `table` joins them)."""
    lines = text.splitlines()
    header = re.split(r"\s{2,}", lines[0].strip())
    rows = {}
    for line in lines[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(header), line
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return header, rows


def test_no_row_reads_diverged_and_fixed_and_the_legend_explains_both() -> None:
    res = results(2.332, 64.2)
    verdicts = judge(ORDER, ROLES, res, REPRODUCED, FIXED_CHECKS, MECHANISM)
    summary = Summary(
        kind="run", complete=True, variants=res, verdicts={n: v.to_dict() for n, v in verdicts.items()}
    )
    header, rows = columns(results_table(summary))
    assert "diverged" not in header and "above bigram" in header
    # 2.332 is above the bigram level 2.317 while within 0.2 of the reference: the row says so, and
    # its verdict carries the caveat of its failed mechanism check
    assert rows["qk_clip"]["above bigram"] == "yes" and rows["qk_clip"]["verdict"] == "fixed*"
    assert rows["reference"]["above bigram"] == "no" and rows["baseline"]["verdict"] == "reproduced"
    for name, row in rows.items():
        assert not (row.get("diverged") == "yes" and row["verdict"] == FIXED), name
    legend = footer(summary)
    assert "above bigram = val loss non-finite or >= the bigram level 2.317" in legend
    assert CAVEAT_LEGEND in legend
    lines = verdict_lines(summary)
    assert "qk_clip: fixed* (its outcome checks pass; a mechanism check below does not)" in lines
    assert "mechanism: qk_clip_max_after_clip <= 45: 64.2 -> FAIL" in lines
    # no caveat, no caveat legend
    plain = judge(ORDER, ROLES, results(2.30, 41.0), REPRODUCED, FIXED_CHECKS, MECHANISM)
    clean = Summary(
        kind="run",
        complete=True,
        variants=results(2.30, 41.0),
        verdicts={n: v.to_dict() for n, v in plain.items()},
    )
    assert (
        CAVEAT_LEGEND not in footer(clean)
        and columns(results_table(clean))[1]["qk_clip"]["verdict"] == "fixed"
    )

"""The width sweep: the runs it plans, reading finished runs back, the fit and check on recorded
runs (numbers worked out from a known law), and a real (very short) sweep end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from stabkit.harness.recipes import load_recipe
from stabkit.harness.recipes.run.job import Job
from stabkit.harness.recipes.science import widths as widths_mod
from stabkit.harness.recipes.science.widths import (
    ScaleReport,
    at_width,
    refit,
    run_key,
    run_widths,
    scaled_variants,
)

from .test_scaling import LAW, LRS, WIDTHS, law_log, true_crossing


def test_the_default_variants_are_the_baseline_and_its_qk_norm_fix() -> None:
    recipe = load_recipe("attention-logit-growth", "tiny")
    assert [v.name for v in scaled_variants(recipe)] == ["baseline", "qk_norm"]
    with pytest.raises(ValueError, match="no variant 'nope'"):
        scaled_variants(recipe, ["nope"])


def test_a_width_the_heads_do_not_divide_is_refused_with_the_reason() -> None:
    recipe = load_recipe("attention-logit-growth", "tiny")
    assert at_width(recipe, 128).model.d_model == 128 and recipe.model.d_model == 64
    with pytest.raises(ValueError, match="width 30: .*n_heads=4 must divide d_model=30"):
        at_width(recipe, 30)


def recorded(check_width: int = 256) -> ScaleReport:
    report = ScaleReport(
        recipe="r", size="tiny", steps=10, seed=0, widths=list(WIDTHS), check_width=check_width,
        lrs=list(LRS), threshold=1e4, variants=["baseline", "qk_norm"],
    )  # fmt: skip
    for w in [*WIDTHS, check_width]:
        for lr in LRS:
            z = 10 ** law_log(w, lr)
            report.runs[run_key(w, "baseline", lr)] = {"width": w, "variant": "baseline", "lr": lr,
                                                      "status": "done", "max_attn_logit": z}  # fmt: skip
            if w != check_width:
                report.runs[run_key(w, "qk_norm", lr)] = {"width": w, "variant": "qk_norm", "lr": lr,
                                                         "status": "done", "max_attn_logit": 6.0}  # fmt: skip
    return report


def test_refit_predicts_the_check_width_from_the_others_and_measures_the_error() -> None:
    report = recorded(256)
    refit(report, predict_widths=[4096])
    base = report.fits["baseline"]
    assert base["law"]["params"] == pytest.approx(LAW, abs=1e-6)  # the check width is not in the fit
    assert base["law"]["widths"] == list(WIDTHS)
    assert base["predictions"]["256"]["lr"] == pytest.approx(true_crossing(256), rel=1e-6)
    assert base["predictions"]["4096"]["lr"] == pytest.approx(true_crossing(4096), rel=1e-6)
    # measured on d256's own grid: between 0.3 (just below 1e4 by the law) and 1.0, in log-log
    lo, hi = 0.3, 1.0
    assert 10 ** law_log(256, lo) < 1e4 < 10 ** law_log(256, hi)
    t = (4 - law_log(256, lo)) / (law_log(256, hi) - law_log(256, lo))
    measured = 10 ** (math.log10(lo) + t * (math.log10(hi) - math.log10(lo)))
    assert base["measured"]["256"] == pytest.approx(measured, rel=1e-9)
    assert report.check is not None
    assert report.check["error_decades"] == pytest.approx(math.log10(true_crossing(256) / measured), abs=1e-6)
    assert "error" in report.fits["qk_norm"]["law"]  # never grows past the floor: no law, said why
    assert report.fits["qk_norm"]["measured"]["64"] is None


def test_the_check_error_is_measured_where_the_check_width_crosses_on_its_grid() -> None:
    report = recorded(512)  # crosses at 0.26, inside the grid
    refit(report)
    c = report.check
    assert c is not None and c["measured"] is not None
    lo, hi = 0.1, 0.3  # the grid points around the crossing: interpolated in log-log between them
    zlo, zhi = law_log(512, lo), law_log(512, hi)
    t = (4 - zlo) / (zhi - zlo)
    expected = 10 ** (math.log10(lo) + t * (math.log10(hi) - math.log10(lo)))
    assert c["measured"] == pytest.approx(expected, rel=1e-9)
    assert c["error_decades"] == pytest.approx(math.log10(true_crossing(512) / expected), abs=1e-6)


def test_a_short_sweep_runs_resumes_and_plots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = load_recipe("attention-logit-growth", "tiny", steps=4)
    kwargs = dict(widths=[16, 32], lrs=[1.0], check_width=48, device="cpu", workers=1)
    report = run_widths(recipe, tmp_path, **kwargs)  # type: ignore[arg-type]
    assert sorted(report.runs) == [
        "d16/baseline/lr_1e+00",
        "d16/qk_norm/lr_1e+00",
        "d32/baseline/lr_1e+00",
        "d32/qk_norm/lr_1e+00",
        "d48/baseline/lr_1e+00",
    ]  # fmt: skip  (the check width trains the baseline only)
    assert report.complete and all(r["status"] == "done" for r in report.runs.values())
    assert all(r["max_attn_logit"] > 0 for r in report.runs.values())
    assert "at least 7 runs" in report.fits["baseline"]["law"]["error"]  # 2 runs: no law, said why
    saved = json.loads((tmp_path / "scale.json").read_text())
    assert saved["runs"].keys() == report.runs.keys()
    assert (tmp_path / "d48" / "baseline" / "lr_1e+00").is_dir()
    trained: list[str] = []
    real = widths_mod.execute

    def counted(jobs: list[Job], *args: Any) -> bool:
        trained.extend(job.run for job in jobs)
        return real(jobs, *args)

    monkeypatch.setattr(widths_mod, "execute", counted)
    again = run_widths(recipe, tmp_path, **kwargs)  # type: ignore[arg-type]
    assert again.runs == report.runs and trained == []  # every run read back, none trained again
    if not str(report.plot).startswith("skipped"):
        assert Path(str(report.plot)).stat().st_size > 10_000

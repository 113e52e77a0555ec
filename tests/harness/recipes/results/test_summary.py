"""`Summary`: one type for `run_recipe` and `run_sweep`, whose `to_dict` is the JSON on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stabkit.harness.recipes import load_recipe
from stabkit.harness.recipes.results.report import load_run
from stabkit.harness.recipes.results.summary import HEADER as HEADER_FIELDS
from stabkit.harness.recipes.results.summary import Summary
from stabkit.harness.recipes.run.runner import describe

HEADER = [
    "processes",
    "recipe",
    "description",
    "source",
    "size",
    "device",
    "seed",
    "steps",
    "data",
    "model",
    "train",
    "fault",
    "expect",
    "criteria",
    "variant_roles",
]  # fmt: skip  (the keys of summary.json before Summary existed)


def test_a_run_summary_has_the_keys_of_summary_json_in_order() -> None:
    recipe = load_recipe("attention-logit-growth", "tiny")
    s = Summary(kind="run", **describe(recipe, "cpu"), started="2025-01-01T00:00:00+00:00")
    assert list(describe(recipe, "cpu")) == HEADER == list(HEADER_FIELDS)
    # before any variant ends: no "seconds"; no "stopped_by" unless a SIGTERM stopped the run
    assert list(s.to_dict()) == [
        "kind",
        *HEADER,
        "started",
        "complete",
        "interrupted",
        "variants",
        "verdicts",
    ]
    s.seconds, s.stopped_by = 3.0, "SIGTERM"
    assert list(s.to_dict())[-2:] == ["seconds", "stopped_by"]
    assert s.to_dict()["fault"] is None  # a header field that is None today stays in the file


def test_a_sweep_summary_adds_its_grid_and_plot() -> None:
    recipe = load_recipe("lr-sensitivity", "tiny")
    s = Summary(
        kind="sweep", **describe(recipe, "cpu"), lrs=[0.1], high=[0.01, 0.3], convention="c", started="t"
    )
    s.seconds, s.plot = 1.0, "lr_sweep.png"
    keys = list(s.to_dict())
    assert keys == ["kind", *HEADER, "lrs", "high", "convention", "started", "complete", "interrupted",
                    "variants", "verdicts", "seconds", "plot"]  # fmt: skip


def test_from_dict_round_trips_and_keeps_unknown_keys() -> None:
    recipe = load_recipe("attention-logit-growth", "tiny")
    s = Summary(kind="run", **describe(recipe, "cpu"), started="t", complete=True, seconds=2.0)
    s.variants["baseline"] = {"status": "done", "val_loss": 2.5}
    data = json.loads(json.dumps(s.to_dict()))
    back = Summary.from_dict(data)
    assert back.to_dict() == data and back.variants == s.variants and back.train == data["train"]
    newer = Summary.from_dict({**data, "future_key": 1})
    assert newer.extra == {"future_key": 1} and newer.to_dict()["future_key"] == 1


def test_a_minimal_file_reads_as_complete_like_before(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"kind": "run", "recipe": "r", "variants": {}}))
    s = load_run(tmp_path)
    assert s.kind == "run" and s.complete is True and s.verdicts == {} and s.size is None
    with pytest.raises(ValueError, match="kind"):
        Summary(kind="other")
    with pytest.raises(ValueError, match="JSON object"):
        Summary.from_dict([])  # type: ignore[arg-type]

"""`RunResult.to_dict` is the summary entry the worker's plain dict used to be, key for key and in the
same order, so ``summary.json`` and `stabkit report` read as before.

``data/results_before_run_result.json`` was written by the worker and the pool before `RunResult`
existed (run_job on shortened built-in recipes: every status, a rescue variant, a fault, a depth
sweep, a held-out curve; event lists cut to two events; ``seconds`` dropped, log folders under
``TMP``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from stabkit.harness.recipes import load_recipe
from stabkit.harness.recipes.results.run_result import RunResult
from stabkit.harness.recipes.run.worker import Job, run_job
from stabkit.sinks.jsonl import json_safe

BEFORE: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "data" / "results_before_run_result.json").read_text()
)


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_an_entry_written_before_reads_back_and_writes_the_same(name: str) -> None:
    entry = BEFORE[name]
    result = RunResult.from_dict(entry)
    assert result.extra == {}, "every key is a field"
    again = result.to_dict()
    assert list(again) == list(entry)
    assert json.dumps(again) == json.dumps(entry)


def test_statuses_and_shapes_are_covered() -> None:
    statuses = {e["status"] for e in BEFORE.values()}
    assert statuses == {"done", "stopped", "failed", "interrupted", "not run"}
    keys = {k for e in BEFORE.values() for k in e}
    assert {"depth", "val_curve", "stopped", "error", "rescues", "fault_step", "events/nonfinite"} <= keys


def test_rows_per_process_sits_after_the_held_out_numbers() -> None:
    entry = dict(BEFORE["alg/baseline"])
    result = RunResult.from_dict(entry)
    result.rows_per_process = 4.0
    keys = list(result.to_dict())
    assert keys[keys.index("mean_logit") + 1] == "rows_per_process"
    assert keys[keys.index("rows_per_process") + 1] == "max_attn_logit"


def same(new: Any, old: Any, where: str) -> None:
    if isinstance(old, dict):
        assert isinstance(new, dict) and list(new) == list(old), where
        for k in old:
            same(new[k], old[k], f"{where}.{k}")
    elif isinstance(old, list):
        assert isinstance(new, list) and len(new) == len(old), where
        for i, (n, o) in enumerate(zip(new, old)):
            same(n, o, f"{where}[{i}]")
    elif isinstance(old, float) and not isinstance(new, str):
        assert new == pytest.approx(old, rel=1e-4, abs=1e-6), where
    else:
        assert new == old, where


def test_a_run_now_writes_what_the_worker_wrote_before(tmp_path: Path) -> None:
    recipe = load_recipe("nan-injection", "tiny", steps=12)
    result = run_job(Job(recipe, "baseline", str(tmp_path / "nan" / "baseline")))
    entry = json_safe(result.to_dict())
    assert entry.pop("seconds") > 0
    entry["logdir"] = entry["logdir"].replace(str(tmp_path), "TMP")
    entry["event_list"] = entry["event_list"][:2]
    for event in entry["event_list"]:  # added since the stored data: the severity and the incident
        assert event.pop("severity") == "critical" and event["details"].pop("incident") == 1
    old = BEFORE["nan/baseline"]
    assert list(entry) == list(old)
    same(entry, old, "nan/baseline")
    assert math.isnan(result.val_loss) and result.measures is not None and result.measures.events == 6

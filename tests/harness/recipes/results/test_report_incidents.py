"""`incidents_text`: one line per incident (the last row of an id), events in no incident listed after,
each advice once; a log without incident rows is listed event by event, as before incidents."""

from __future__ import annotations

from typing import Any

from stabkit.harness.recipes.results.report_incidents import incidents_text
from stabkit.harness.recipes.results.summary import Summary


def event(step: int, where: str, incident: int | None, advice: str = "lower the LR") -> dict[str, Any]:
    details = {} if incident is None else {"incident": incident}
    return {"type": "event", "step": step, "kind": "spike", "where": where, "message": f"{where} jumped",
            "advice": advice, "details": details, "severity": "warning"}  # fmt: skip


def incident(id: int, step: int, members: int, headline: str, severity: str = "warning") -> dict[str, Any]:
    return {"type": "incident", "id": id, "first_step": step, "last_step": step, "severity": severity,
            "kinds": ["spike"], "members": members, "first": "loss", "headline": headline}  # fmt: skip


def summary(events: list[dict[str, Any]], incidents: list[dict[str, Any]]) -> Summary:
    result = {"status": "logged", "logdir": "x", "event_list": events, "incident_list": incidents}
    return Summary(kind="log", complete=True, variants={"exp": result})


def test_one_line_per_incident_and_members_on_request() -> None:
    events = [event(5, "loss", 1), event(5, "grad/global_norm", 1, "clip"), event(40, "loss", None)]
    rows = [incident(1, 5, 1, "incident 1 first"), incident(1, 5, 2, "incident 1 grown", "critical")]
    text = incidents_text(summary(events, rows)).splitlines()
    assert text == [
        "exp: 3 event(s) in 1 incident(s)",
        "    critical incident 1 grown",  # the last row of the id
        "    step 40: [spike] loss: loss jumped",  # in no incident
        "    (--members lists each incident's events)",
        "    advice: lower the LR",
        "    advice: clip",
    ]
    full = incidents_text(summary(events, rows), members=True).splitlines()
    assert full[2:4] == [
        "        step 5: [spike] loss: loss jumped",
        "        step 5: [spike] grad/global_norm: grad/global_norm jumped",
    ]


def test_a_rescue_is_listed_under_its_incident_without_members() -> None:
    rescue = {**event(6, "qk_norm", 1), "kind": "rescue", "message": "rescue 1/2"}
    text = incidents_text(summary([event(5, "loss", 1), rescue], [incident(1, 5, 2, "incident 1")]))
    assert text.splitlines()[1:3] == [
        "    warning  incident 1",
        "        step 6: [rescue] qk_norm: rescue 1/2",
    ]


def test_a_log_without_incidents_lists_its_events() -> None:
    text = incidents_text(summary([event(3, "loss", None), event(9, "loss", None)], [])).splitlines()
    assert text[0] == "exp: 2 event(s)"
    assert text[1:3] == ["    step 3: [spike] loss: loss jumped", "    step 9: [spike] loss: loss jumped"]

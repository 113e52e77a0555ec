"""The audit's risks reach the console once, at attach, as one short block on stderr."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zoo import EncoderLM, reference_gpt, train_steps

import stabkit
from stabkit.sinks.audit_console import audit_block


def _attach(model: torch.nn.Module, **cfg: object) -> tuple[stabkit.Monitor, torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = stabkit.MonitorConfig(tensorboard=False, jsonl=False, log_every=2, **cfg)  # type: ignore[arg-type]
    return stabkit.attach(model, opt, config=config), opt


@pytest.mark.parametrize("build", [reference_gpt, EncoderLM])
def test_each_risk_of_the_audit_is_one_console_line_once(build, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = build()
    expected = stabkit.audit(model, torch.optim.AdamW(model.parameters(), lr=1e-3))  # the audit on its own
    mon, opt = _attach(model)
    train_steps(model, opt, mon, 4)  # two log intervals: the block is not repeated
    mon.detach()
    err = capsys.readouterr().err.splitlines()
    head = [line for line in err if line.startswith("[stabkit] audit (")]
    assert head == [
        f"[stabkit] audit ({expected.family}): {len(expected.risks)} risk(s), {len(expected.notes)} note(s) "
        "- details: `stabkit inspect --audit`, or the stabkit/audit text in TensorBoard"
    ]
    risk_lines = [line for line in err if line.startswith("[stabkit]   ")]
    assert [line.split()[1] for line in risk_lines] == [f.rule for f in expected.risks]
    for line, finding in zip(risk_lines, expected.risks, strict=True):
        assert line.endswith("-> fix: " + " | ".join(finding.fix))


def test_no_block_without_console_or_audit(capsys: pytest.CaptureFixture[str]) -> None:
    for cfg in ({"console": False}, {"audit": False}):
        mon, _ = _attach(reference_gpt(), **cfg)
        mon.detach()
        assert "audit" not in capsys.readouterr().err


def test_block_folds_long_path_lists_and_skips_risk_free_reports() -> None:
    finding = {
        "rule": "r",
        "severity": "risk",
        "where": [f"blocks.{i}" for i in range(6)],
        "fix": ["qk_norm"],
    }
    note = {"rule": "n", "severity": "note", "where": ["x"], "fix": ["y"]}
    block = audit_block({"family": "f", "findings": [finding, note]})
    assert block is not None
    assert block.splitlines()[1] == "[stabkit]   r at blocks.0, blocks.1, +4 more -> fix: qk_norm"
    assert block.startswith("[stabkit] audit (f): 1 risk(s), 1 note(s)")
    assert audit_block({"family": "f", "findings": [note]}) is None


def test_the_jsonl_still_holds_the_whole_audit(tmp_path: Path) -> None:
    from stabkit.sinks import LOG_NAME, read_jsonl

    mon = stabkit.attach(reference_gpt(), logdir=tmp_path, config=stabkit.MonitorConfig(console=False))
    mon.detach()
    audits = [r for r in read_jsonl(tmp_path / LOG_NAME) if r.get("type") == "audit"]
    assert len(audits) == 1 and audits[0]["summary"]["risks"] == len(mon.audit_report.risks)

"""`stabkit alarms`: bad input exits 2 with one line before anything trains; --list names the corpus."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from stabkit.cli import main
from stabkit.harness.alarms.corpus import CORPUS


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--configs", "no-such-*"], "matches no healthy config"),
        (["--recipes", "loss-spike,bogus"], "unknown recipe(s) bogus"),
        (["--steps", "0"], "--steps"),
        (["--workers", "0"], "--workers"),
        (["--monitor", "half"], "--monitor"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], needle: str, tmp_path: object) -> None:
    result = CliRunner().invoke(main, ["alarms", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("stabkit: error: ") and needle in lines[-1], result.output
    assert "Traceback" not in result.output and "alarms:" not in result.output  # nothing started


def test_list_names_every_selected_config() -> None:
    result = CliRunner().invoke(main, ["alarms", "--list"])
    assert result.exit_code == 0, result.output
    assert [line.split()[0] for line in result.output.strip().splitlines()] == [c.name for c in CORPUS]
    result = CliRunner().invoke(main, ["alarms", "--list", "--configs", "gpt2-*"])
    assert [line.split()[0] for line in result.output.strip().splitlines()] == [
        "gpt2-l4",
        "gpt2-l12-full",
        "gpt2-l6-adafactor",
    ]

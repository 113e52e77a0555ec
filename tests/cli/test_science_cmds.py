"""`stabkit lead-time` and `stabkit scale` refuse bad input before anything trains: exit code 2 and
one line naming the problem."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from stabkit.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["lead-time", "no-such-recipe"], "no-such-recipe"),
        (["lead-time", "--seeds", "0"], "--seeds"),
        (["scale", "--widths", "64"], "--widths needs at least two widths"),
        (["scale", "--widths", "32,abc"], "--widths must be positive integers"),
        (["scale", "--widths", "32,30"], "width 30: GPTConfig.n_heads=4 must divide d_model=30"),
        (["scale", "--check", "102"], "width 102"),
        (["scale", "--variants", "nope"], "no variant 'nope'"),
        (["scale", "--threshold", "0.5"], "--threshold must be a number above 1"),
        (["scale", "--lrs", "0.1,-1"], "--lrs must be positive numbers"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args: list[str], message: str, tmp_path: object) -> None:
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert any(message in line for line in lines), result.output
    assert len(lines) <= 3, result.output  # click's usage line may precede the error

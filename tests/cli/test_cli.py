"""The CLI: inspect prints maps, bad input exits 2 with one line, demo trains and writes logs."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_process import StabkitCLI
from click.testing import CliRunner

from stabkit.cli import main
from stabkit.sinks import LOG_NAME, read_jsonl


@pytest.mark.parametrize("spec", ["tiny", "hf:gpt2", "hf:llama"])
def test_inspect_prints_the_map(spec: str) -> None:
    result = CliRunner().invoke(main, ["inspect", spec], standalone_mode=False)
    assert result.exit_code == 0, result.output
    assert "block 0:" in result.output and "output head:" in result.output
    if spec == "hf:llama":
        assert "model.layers.31.self_attn" in result.output  # LlamaConfig() default: 32 layers


@pytest.mark.multiprocess
def test_inspect_bad_spec_exits_2_with_one_line(stabkit_cli: StabkitCLI) -> None:
    proc = stabkit_cli.run("inspect", "hf:nonsense")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "hf:nonsense" in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.multiprocess
def test_unknown_option_exits_2_with_one_line(stabkit_cli: StabkitCLI) -> None:
    proc = stabkit_cli.run("demo", "--steps", "zero")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--steps" in proc.stderr


@pytest.mark.multiprocess
def test_demo_trains_and_logs(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    logdir = tmp_path / "demo"
    proc = stabkit_cli.run("demo", "--steps", "60", "--logdir", str(logdir))
    assert proc.returncode == 0, proc.stderr
    assert "loss" in proc.stdout and str(logdir) in proc.stdout
    rows = [r for r in read_jsonl(logdir / LOG_NAME) if r["type"] == "metrics"]
    assert [r["step"] for r in rows] == list(range(60))
    first, last = rows[0]["values"]["loss"], rows[-1]["values"]["loss"]
    assert last < first - 1.0, "the demo model must learn something"
    assert any(p.name.startswith("events.out.tfevents") for p in logdir.iterdir())

"""Bad paths and recipe values are found before anything trains: exit code 2 and one line naming the
problem (an output folder that cannot be written, missing or too-short training text, an absurd
batch size); `--steps` above the recipe's is called a lengthened run, not a shortened one."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from cli_process import StabkitCLI
from click.testing import CliRunner

import stabkit.cli.app
from stabkit.cli import main
from stabkit.cli.run_cmd import header
from stabkit.harness.recipes import load_recipe
from stabkit.harness.recipes.spec.loader import builtin_dir

BUILTIN = builtin_dir()
RECIPE = (BUILTIN / "attention-logit-growth.toml").read_text()


def one_line_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert all(n in lines[0] for n in needles), lines[0]
    return lines[0]


def recipe_file(tmp_path: Path, old: str, new: str) -> Path:
    assert old in RECIPE
    path = tmp_path / "r.toml"
    path.write_text(RECIPE.replace(old, new))
    return path


@pytest.mark.multiprocess
@pytest.mark.parametrize("command", ["run", "demo"])
def test_output_folder_that_cannot_be_created_exits_2(
    tmp_path: Path, command: str, stabkit_cli: StabkitCLI
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be made below a file, not even by root
    out = str(blocker / "out")
    if command == "run":
        proc = stabkit_cli.run("run", "attention-logit-growth", "--steps", "2", "--jobs", "1", "--out", out)
        one_line_error(proc, "--out", out, "cannot write there")
    else:
        proc = stabkit_cli.run("demo", "--steps", "2", "--logdir", out)
        one_line_error(proc, "--logdir", out, "cannot write there")


@pytest.mark.parametrize(
    "args", [["run", "attention-logit-growth", "--steps", "2"], ["demo", "--steps", "2"]]
)
def test_read_only_output_folder_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """A read-only file system (EROFS): tests run as root, where chmod does not stop writes."""

    def read_only(*_: Any, **__: Any) -> Any:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(stabkit.cli.app.tempfile, "mkstemp", read_only)
    flag = "--out" if args[0] == "run" else "--logdir"
    result = CliRunner().invoke(main, [*args, flag, str(tmp_path / "ro")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("stabkit: error: ") and "Read-only file system" in lines[-1]
    assert flag in lines[-1] and "Traceback" not in result.output


@pytest.mark.multiprocess
def test_missing_data_path_is_found_when_the_recipe_loads(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    path = recipe_file(tmp_path, '# [data]\n# path = "my.txt"', '[data]\npath = "nope.txt"')
    one_line_error(
        stabkit_cli.run("run", str(path), "--steps", "2", "--out", str(tmp_path / "o")),
        "data.path",
        "nope.txt",
    )
    assert not (tmp_path / "o" / "summary.json").exists()  # nothing started


@pytest.mark.multiprocess
def test_too_short_data_is_found_when_the_recipe_loads(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    (tmp_path / "short.txt").write_text("tiny text " * 20)
    path = recipe_file(tmp_path, '# [data]\n# path = "my.txt"', '[data]\npath = "short.txt"')
    line = one_line_error(
        stabkit_cli.run("run", str(path), "--steps", "2", "--out", str(tmp_path / "o")), "data.path"
    )
    assert "200 bytes" in line and "at least 1000" in line
    line = one_line_error(
        stabkit_cli.run(
            "sweep", "lr-sensitivity", "--data", str(tmp_path / "short.txt"), "--out", str(tmp_path / "s")
        ),
        "--data",
    )
    assert "200 bytes" in line


def test_data_must_cover_the_context_of_a_larger_preset(tmp_path: Path) -> None:
    """1000 bytes suffice for the tiny preset's context (64), not for gpt2's (1024)."""
    text = tmp_path / "t.txt"
    text.write_bytes(b"x" * 5000)
    load_recipe("attention-logit-growth", "tiny", data=str(text))
    with pytest.raises(ValueError, match="context 1024"):
        load_recipe("attention-logit-growth", "gpt2", data=str(text))


@pytest.mark.multiprocess
@pytest.mark.parametrize("value", ["0", "100000", "-3"])
def test_batch_size_has_a_bound_with_a_clear_message(
    tmp_path: Path, value: str, stabkit_cli: StabkitCLI
) -> None:
    path = recipe_file(tmp_path, "steps = 300\n", f"steps = 300\nbatch_size = {value}\n")
    line = one_line_error(stabkit_cli.run("run", str(path), "--steps", "2"), "train.batch_size", "[1, 4096]")
    if value == "100000":
        assert "train.grad_accum" in line


def test_more_steps_than_the_recipe_is_a_lengthened_run() -> None:
    longer = header(load_recipe("attention-logit-growth", steps=400), "cpu", 1, 300)
    assert "lengthened run (400 steps; the recipe has 300)" in longer and "shortened" not in longer
    shorter = header(load_recipe("attention-logit-growth", steps=20), "cpu", 1, 300)
    assert "shortened run (20 of 300 steps)" in shorter
    same = header(load_recipe("attention-logit-growth", steps=300), "cpu", 1, 300)
    assert "shortened" not in same and "lengthened" not in same


@pytest.mark.multiprocess
def test_an_unknown_recipe_name_exits_2_naming_the_builtins(stabkit_cli: StabkitCLI) -> None:
    line = one_line_error(
        stabkit_cli.run("run", "no-such-recipe"), "no-such-recipe", "attention-logit-growth", "loss-spike"
    )
    assert "not found" in line


def test_list_recipes_lists_the_builtins(tmp_path: Path) -> None:
    from stabkit.harness.recipes.spec.loader import builtin_recipes

    result = CliRunner().invoke(main, ["list", "recipes"], standalone_mode=False)
    assert result.exit_code == 0, result.output
    for name, path in builtin_recipes().items():
        assert f"{name}  ({path})" in result.output

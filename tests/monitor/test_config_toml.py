"""MonitorConfig.from_toml reads the [monitor] and [detect] tables a recipe uses, and says what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

import stabkit

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "monitor.toml"
    path.write_text(text)
    return path


def test_a_recipes_monitor_table_is_read() -> None:
    cfg = stabkit.MonitorConfig.from_toml(RECIPES / "attention-logit-growth.toml")
    # the recipe's [monitor]: every = 10, attn_every = 5, log_every = 50
    assert (cfg.every, cfg.attn_every, cfg.log_every, cfg.attention_every) == (10, 5, 50, 5)
    assert cfg.detect == stabkit.DetectConfig()  # no [detect] table: the default detectors


def test_a_recipes_detect_table_is_read() -> None:
    cfg = stabkit.MonitorConfig.from_toml(RECIPES / "loss-spike.toml")  # [detect] sync = true
    assert cfg.detect is not None and cfg.detect.sync is True
    assert cfg.every == stabkit.MonitorConfig().every  # no [monitor]: the library default


def test_every_kind_of_field_and_the_overrides(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
[monitor]
every = 3
families = ["loss", "grad"]
modules = ["blocks.*.mlp"]
attn_sample_rows = "none"
console = false
logdir_mode = "append"
wandb = { project = "p", mode = "offline" }

[detect]
detectors = ["nonfinite", "spike"]
""",
    )
    cfg = stabkit.MonitorConfig.from_toml(path, log_every=7)
    assert cfg.every == 3 and cfg.log_every == 7
    assert cfg.families == frozenset({"loss", "grad"}) and list(cfg.modules) == ["blocks.*.mlp"]  # type: ignore[arg-type]
    assert cfg.attn_sample_rows is None and cfg.console is False and cfg.logdir_mode == "append"
    assert isinstance(cfg.wandb, stabkit.config.WandbOptions)
    assert (cfg.wandb.project, cfg.wandb.mode) == ("p", "offline")
    assert cfg.detect is not None and cfg.detect.detectors == ("nonfinite", "spike")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[monitor]\nevry = 3\n", r"monitor\.toml: monitor\.evry: unknown key"),
        ("[monitor]\nevery = 0\n", r"monitor\.every"),
        ("[monitor]\nevery = 'ten'\n", r"monitor\.every"),
        ("[monitor]\ndetect = {}\n", r"monitor\.detect"),
        ("every = 3\n", r"every must sit under a \[monitor\] table"),
        ("[monitor\nevery = 3\n", r"not valid TOML"),
    ],
)
def test_bad_files_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stabkit.MonitorConfig.from_toml(_write(tmp_path, text))


def test_a_missing_file_is_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        stabkit.MonitorConfig.from_toml(tmp_path / "nope.toml")


@pytest.mark.parametrize("name", ["attention-logit-growth", "muon-logit-growth"])
def test_the_same_monitor_settings_as_the_recipe_runner(name: str) -> None:
    from stabkit.harness.recipes.spec.loader import read_toml
    from stabkit.harness.recipes.spec.schema import parse_monitor

    path = RECIPES / f"{name}.toml"
    runner = parse_monitor(read_toml(path)["monitor"])
    ours = stabkit.MonitorConfig.from_toml(path)
    assert {k: v for k, v in vars(ours).items() if k != "detect"} == {
        k: v for k, v in vars(runner).items() if k != "detect"
    }

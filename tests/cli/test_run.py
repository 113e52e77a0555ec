"""`stabkit run / sweep / report / list` on shortened runs: tables, files, exit codes, Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
from cli_process import StabkitCLI, logged, wait_until
from click.testing import CliRunner

from stabkit.cli import main
from stabkit.harness.recipes.science.sweep import lr_sensitivity
from stabkit.harness.recipes.spec.loader import builtin_dir
from stabkit.sinks import LOG_NAME, read_jsonl

BUILTIN = builtin_dir()


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return result.exit_code, result.output


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "no/such/recipe.toml"], "no/such/recipe.toml"),
        (["run", "attention-logit-growth", "--size", "huge"], "--size"),
        (["sweep", "lr-sensitivity", "--lrs", "0.1,abc"], "--lrs"),
        (["report", "no/such/rundir"], "no/such/rundir"),
        (["list", "everything"], "interventions"),
    ],
)
def test_bad_input_exits_2_with_one_line(args: list[str], needle: str, stabkit_cli: StabkitCLI) -> None:
    proc = stabkit_cli.run(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr


@pytest.mark.multiprocess
def test_bad_recipe_key_exits_2_naming_the_key(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    text = (BUILTIN / "attention-logit-growth.toml").read_text()
    (tmp_path / "a.toml").write_text(text.replace("warmup = 15", "warmpu = 15"))
    (tmp_path / "b.toml").write_text(text.replace("clip = 1.0", "clip = -1.0"))
    for name, key, allowed in (
        ("a", "train.warmpu", "allowed: steps"),
        ("b", "train.clip", '(0, inf) or "none"'),
    ):
        proc = stabkit_cli.run("run", str(tmp_path / f"{name}.toml"), "--steps", "5")
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and key in lines[0] and allowed in lines[0], lines


def test_run_prints_table_verdicts_and_report_reads_it_back(tmp_path: Path) -> None:
    out = tmp_path / "alg"
    code, text = invoke("run", "attention-logit-growth", "--steps", "20", "--jobs", "1", "--out", str(out))
    assert code == 0, text
    for name in ("baseline", "qk_norm", "attn_softcap", "rescue", "reference"):
        assert f"\n{name} " in text and f"\n{name}: " in text  # a table row and a verdict
    assert "shortened run (20 of 300 steps)" in text and "max attn logit" in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is True and summary["steps"] == 20
    code, report = invoke("report", str(out))
    assert code == 0 and "events and advice" in report
    for name, v in summary["verdicts"].items():
        assert f"{name}: {v['verdict']}" in report


def test_report_reads_a_single_monitored_run(tmp_path: Path) -> None:
    import torch

    import stabkit
    from stabkit.harness.models import GPT, preset_config

    model = GPT(preset_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with stabkit.attach(
        model, opt, logdir=tmp_path, config=stabkit.MonitorConfig(console=False, log_every=5)
    ) as mon:
        for _ in range(10):
            x = torch.randint(0, 256, (2, 16))
            loss = model(x).logsumexp(-1).mean()
            loss.backward()
            opt.step()
            mon.step(loss)
            opt.zero_grad()
    code, text = invoke("report", str(tmp_path))
    assert code == 0 and tmp_path.name in text and "0 event(s)" in text


def test_sweep_writes_sensitivities_that_follow_from_its_losses(tmp_path: Path) -> None:
    out = tmp_path / "sw"
    code, text = invoke(
        "sweep", "lr-sensitivity", "--lrs", "1e-3,1e-1", "--steps", "15", "--jobs", "1", "--out", str(out)
    )
    assert code == 0, text
    assert "LR sensitivity" in text and "final held-out loss by peak LR" in text
    s = json.loads((out / "sweep.json").read_text())
    assert s["complete"] and s["lrs"] == [1e-3, 1e-1]
    losses = {
        name: {float(lr): r["val_loss"] for lr, r in v["runs"].items()} for name, v in s["variants"].items()
    }
    best = min(x for ls in losses.values() for x in ls.values())
    for name, v in s["variants"].items():
        assert v["lr_sensitivity"] == pytest.approx(lr_sensitivity(losses[name], v["init_loss"], best))
        high = [min(losses[name][lr], v["init_loss"]) - best for lr in losses[name] if 1e-2 <= lr <= 3e-1]
        assert v["lr_sensitivity_high"] == pytest.approx(sum(high) / len(high))
        for lr in ("0.001", "0.1"):
            assert read_jsonl(Path(v["runs"][lr]["logdir"]) / LOG_NAME)  # each run logged
    assert (out / "lr_sweep.png").stat().st_size > 1000
    tb_files = [p for p in (out / "baseline" / "lr_1e-01").iterdir() if p.name.startswith("events.out")]
    assert len(tb_files) >= 2  # the monitor's run and the hparams record
    code, report = invoke("report", str(out))
    assert code == 0 and "LR sensitivity" in report


def test_list_sections() -> None:
    code, text = invoke("list", "interventions")
    assert code == 0 and "qk_norm" in text and "z_loss" in text
    code, text = invoke("list", "recipes")
    for name in ("attention-logit-growth", "nan-injection", "low-precision", "lr-sensitivity"):
        assert name in text
    code, text = invoke("list", "presets")
    # tiny: 2 blocks x (4·64² attention + 2·64·256 MLP + 2·64 norm gains) + 64 final norm gain
    tiny_params = 2 * (4 * 64 * 64 + 2 * 64 * 256 + 2 * 64) + 64
    assert f"{tiny_params / 1e6:.2f} M" in text.splitlines()[2]
    code, text = invoke("list")
    assert all(f"== {s} ==" in text for s in ("interventions", "recipes", "presets", "advice"))


@pytest.mark.multiprocess
@pytest.mark.signals
def test_ctrl_c_leaves_flushed_logs_and_a_partial_summary(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    out = tmp_path / "int"
    proc = stabkit_cli.start(
        "run", "attention-logit-growth", "--steps", "3000", "--jobs", "2", "--out", str(out)
    )
    logs = [out / "baseline" / LOG_NAME, out / "qk_norm" / LOG_NAME]
    wait_until(logged(*logs))
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["interrupted"] is True
    statuses = {n: r["status"] for n, r in summary["variants"].items()}
    assert statuses["baseline"] == "interrupted" and statuses["qk_norm"] == "interrupted", statuses
    assert set(statuses.values()) <= {"interrupted", "not run"}
    for path in logs:
        rows = [r for r in read_jsonl(path) if r["type"] == "metrics"]
        assert rows and [r["step"] for r in rows] == list(range(len(rows)))  # flushed, no gap
    assert "PARTIAL: interrupted" in stdout
    assert math.isnan(float(summary["variants"]["baseline"]["diverged"]))


@pytest.mark.multiprocess
def test_data_flag_trains_on_the_users_text(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    text = tmp_path / "mine.txt"
    text.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "d"
    code, output = invoke(
        "run", "attention-logit-growth", "--data", str(text), "--steps", "5", "--jobs", "1", "--out", str(out)
    )
    assert code == 0, output
    s = json.loads((out / "summary.json").read_text())
    assert s["data"] == str(text)
    from stabkit.harness.recipes.results.measures import bigram_loss

    assert s["variants"]["baseline"]["bigram_loss"] == pytest.approx(bigram_loss(str(text)))
    assert s["variants"]["baseline"]["bigram_loss"] < 1.0  # a repetitive text: far below the embedded 2.317
    missing = stabkit_cli.run("run", "attention-logit-growth", "--data", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and "nope.txt" in missing.stderr
